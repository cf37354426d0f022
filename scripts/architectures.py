"""The architecture matrix: run the six checks on a tiny model of every decoder-only causal LM in the pinned
transformers (``tests/helpers/architectures.py``), write the results to ``docs/supported-models.json`` and render
the Supported models page (``docs/supported-models.md``) from that file.

Each model type runs in its own process (a model that crashes the interpreter or hangs costs only its own row, and
memory is returned); the file is written whole at the end through a temporary file. ``tests/test_architectures.py``
checks that the page equals what this script renders from the committed file, and (``-m architectures``) that every
type still gets the status the file records.

Usage (from the repository root)::

    OMP_NUM_THREADS=1 python scripts/architectures.py                 # every type (about 15 min on one core)
    OMP_NUM_THREADS=1 python scripts/architectures.py llama opt       # re-run these rows, keep the others
    python scripts/architectures.py --page                            # only re-render the page from the file
    python scripts/architectures.py --check                           # exit 1 if the page is stale
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "supported-models.json"
PAGE = ROOT / "docs" / "supported-models.md"
BF16 = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "mixtral", "qwen3_moe", "qwen3_5_text", "nemotron_h",
        "lfm2", "llama4_text", "bloom")
"""Types also checked in bfloat16 (what GPU users train in), with bfloat16's tolerances."""
TIMEOUT_S = 300
"""Seconds a process may take (a chunk, or one type re-run alone)."""

STATUS = {
    "pass": "supported: every check holds",
    "refused": "refused at wrap, with the reason",
    "fail": "accepted, but a check fails",
    "no_tiny": "not tested: its plain tiny model does not build or run a padded forward",
    "out_of_scope": "not a decoder-only text LM",
}

FAMILIES = {
    "apertus": "Apertus", "arcee": "Arcee AFM", "biogpt": "BioGPT", "bitnet": "BitNet b1.58",
    "bloom": "BLOOM, BLOOMZ", "codegen": "CodeGen", "cohere": "Command R, Command R+",
    "cohere2": "Command R7B, Command A", "ctrl": "CTRL", "dbrx": "DBRX",
    "deepseek_v2": "DeepSeek-V2, DeepSeek-Coder-V2", "deepseek_v3": "DeepSeek-V3, DeepSeek-R1",
    "ernie4_5": "ERNIE 4.5", "ernie4_5_moe": "ERNIE 4.5 MoE", "exaone4": "EXAONE 4.0",
    "falcon": "Falcon 7B / 40B / 180B", "falcon_h1": "Falcon-H1", "falcon_mamba": "Falcon Mamba",
    "gemma": "Gemma (2B, 7B), CodeGemma", "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3 270M and 1B; the text model of Gemma 3 4B-27B", "gemma3": "Gemma 3 4B-27B",
    "gemma3n_text": "Gemma 3n", "glm4": "GLM-4-0414", "glm4_moe": "GLM-4.5, GLM-4.6", "gpt-sw3": "GPT-SW3",
    "gpt2": "GPT-2, DistilGPT2", "gpt_bigcode": "StarCoder, SantaCoder", "gpt_neo": "GPT-Neo",
    "gpt_neox": "Pythia, GPT-NeoX-20B", "gpt_neox_japanese": "GPT-NeoX-Japanese", "gpt_oss": "gpt-oss",
    "gptj": "GPT-J", "granite": "Granite 3", "granitemoehybrid": "Granite 4.0", "helium": "Helium",
    "hunyuan_v1_moe": "Hunyuan-A13B", "internlm3": "InternLM3", "jamba": "Jamba", "jetmoe": "JetMoE",
    "kimi_linear": "Kimi Linear", "lfm2": "LFM2",
    "llama": "Llama 2, Llama 3 / 3.1 / 3.2 / 3.3, SmolLM2, TinyLlama, DeepSeek-R1-Distill-Llama",
    "llama4": "Llama 4 Scout, Llama 4 Maverick", "llama4_text": "Llama 4 Scout, Llama 4 Maverick (text model)",
    "longcat_flash": "LongCat-Flash", "mamba": "Mamba", "mamba2": "Mamba-2, Codestral Mamba",
    "minicpm3": "MiniCPM3", "minimax": "MiniMax-Text-01", "minimax_m2": "MiniMax-M2",
    "mistral": "Mistral 7B, Mistral NeMo, Mistral Small", "mixtral": "Mixtral 8x7B, Mixtral 8x22B",
    "mpt": "MPT", "nemotron": "Nemotron-4, Minitron", "nemotron_h": "Nemotron-H, Nemotron Nano 2",
    "olmo": "OLMo", "olmo2": "OLMo 2", "olmo3": "OLMo 3", "olmoe": "OLMoE", "openai-gpt": "OpenAI GPT (GPT-1)",
    "opt": "OPT", "persimmon": "Persimmon", "phi": "Phi-1, Phi-1.5, Phi-2",
    "phi3": "Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini", "phimoe": "Phi-3.5-MoE",
    "qwen2": "Qwen2, Qwen2.5, Qwen2.5-Coder, QwQ-32B, DeepSeek-R1-Distill-Qwen",
    "qwen2_moe": "Qwen1.5-MoE, Qwen2-57B-A14B", "qwen3": "Qwen3 (0.6B to 32B)",
    "qwen3_moe": "Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder", "qwen3_next": "Qwen3-Next",
    "qwen3_5": "Qwen3.5", "qwen3_5_text": "Qwen3.5 (text model)", "qwen3_5_moe": "Qwen3.5 MoE",
    "qwen3_5_moe_text": "Qwen3.5 MoE (text model)", "recurrent_gemma": "RecurrentGemma", "rwkv": "RWKV-4",
    "seed_oss": "Seed-OSS", "smollm3": "SmolLM3", "stablelm": "StableLM 2", "starcoder2": "StarCoder2",
    "vaultgemma": "VaultGemma", "xglm": "XGLM", "zamba": "Zamba", "zamba2": "Zamba2",
}
"""Model families published on the Hugging Face Hub, by the ``model_type`` their ``config.json`` gives: shown
beside each type, so a model is found on the page by its name."""
REFUSED_HELP = [
    "## If your model is refused",
    "",
    "The error names the check that refused it, in one line; the note column above gives each type's reason whole. "
    "What you can do:",
    "",
    "- **Train a baseline instead.** LoRA and the other baselines (`--config methods/lora`, `lora16`, `dora`, "
    "`ia3`, `full`) read each example once, causally, as plain PEFT does: they need none of Bitune's passes and "
    "train on any model PEFT trains.",
    "- **Pick a supported model of the same size.** Every *pass* row above runs Bitune end to end; the built-in "
    "`smollm2-135m` (Llama), `gemma3-270m` (Gemma 3) and `qwen2.5-0.5b` (Qwen2) need no download from the Hub.",
    "- **A multimodal checkpoint** (`gemma3`, `qwen3_5`, `llama4`, ...): its row names the text model Bitune "
    "trains, the row of the type that ends in `_text`.",
    "- **A type listed as not tested** may work: wrap runs its checks on any model, listed or not, and refuses in "
    "one line where one fails. [Contributing](contributing.md) says how a family is added; to ask for one, open an "
    "issue with the error line and your `config.json`'s `model_type`.",
]
"""The page's section for a user whose model is refused."""

ROWS = """
import json, sys, torch
sys.path.insert(0, {tests!r})
from helpers import architectures as A
for model_type in {types!r}:
    r = A.run(model_type, dtype=getattr(torch, {dtype!r}))
    print("RESULT " + json.dumps(r.__dict__), flush=True)
"""
CHUNK = 12
"""Types per process: the imports are paid once per chunk; a crash costs the rest of its chunk, re-run alone."""


def run_many(types: list[str], dtype: str = "float32") -> dict[str, dict]:
    """Rows for ``types``, computed in fresh interpreters, :data:`CHUNK` types each; a type whose process dies or
    hangs is re-run alone, and if it fails again its row records that."""
    rows: dict[str, dict] = {}
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=str(ROOT / "src"))
    for start in range(0, len(types), CHUNK):
        chunk = types[start:start + CHUNK]
        for attempt in (chunk, None):
            todo = [t for t in (attempt or chunk) if t not in rows]
            if not todo:
                break
            if attempt is None:  # alone, one by one
                for model_type in todo:
                    rows.update(_run(env, [model_type], dtype) or {model_type: {
                        "model_type": model_type, "status": "fail",
                        "reason": "the check process died or timed out"}})
                break
            rows.update(_run(env, todo, dtype))
        for model_type in chunk:
            print(model_type, dtype, rows[model_type]["status"], flush=True)
    return rows


def _run(env: dict, types: list[str], dtype: str) -> dict[str, dict]:
    code = ROWS.format(tests=str(ROOT / "tests"), types=types, dtype=dtype)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=TIMEOUT_S, env=env)
        out = done.stdout
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    rows = {}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            row = json.loads(line[len("RESULT "):])
            rows[row["model_type"]] = row
    return rows


def versions() -> dict:
    import peft
    import torch
    import transformers
    return {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__}


def write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def _cell(text: str) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def _out_of_scope(model_type: str, row: dict, rows: dict) -> str | None:
    """The note of a multimodal type whose text model is tested on its own row: ``AutoModelForCausalLM`` builds
    that text model (the same class, e.g. ``llama4`` -> ``Llama4ForCausalLM``, the ``llama4_text`` row), or the
    type is a wrapper around it (``gemma3`` -> ``gemma3_text``). None for the others."""
    same = next((t for t, r in sorted(rows.items())
                 if t != model_type and r["status"] != "out_of_scope" and r.get("model_class") == row.get("model_class")),
                None)
    if same is not None:
        return (f"a multimodal checkpoint type: AutoModelForCausalLM loads its text model, {row['model_class']}, "
                f"tested as `{same}` ({rows[same]['status']})")
    text = f"{model_type}_text"
    if text in rows and rows[text]["status"] != "out_of_scope":
        return f"a multimodal wrapper: its text model is tested as `{text}` ({rows[text]['status']})"
    return None


def render(data: dict) -> str:
    """The Supported models page for the matrix ``data`` (what ``docs/supported-models.json`` holds)."""
    rows = data["float32"]
    counts = {s: sum(r["status"] == s for r in rows.values()) for s in STATUS}
    tested = len(rows) - counts["out_of_scope"] - counts["no_tiny"]
    v = data["versions"]
    lines = [
        "# Supported models",
        "",
        "<!-- Generated by `python scripts/architectures.py --page` from docs/supported-models.json; do not edit. -->",
        "",
        f"Every causal-LM type of transformers {v['transformers']} (PEFT {v['peft']}, torch {v['torch']}), as "
        "transformers lists them (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built as a tiny random model (hidden 64, "
        "2 layers, 4 heads / 2 key-value heads, vocab 96; hybrids: every kind of layer twice) and put through six "
        "checks: **wrap** "
        "(`BituneModel.wrap` with LoRA rank 4 succeeds, or refuses in one line), **train** (a padded batch gives "
        "a finite loss; backward reaches both adapter sets wherever a plain LoRA forward reaches, and every "
        "theta), **correct** (at share 0 the answer logits equal a plain causal forward; the fused, batched and "
        "one-by-one paths equal the paper-as-written reference; the bidirectional pass sees a later token in "
        "every layer and the causal one does not; a padded row equals the row alone; the `lora` variant equals "
        "plain PEFT), **generate** (greedy generation equals the argmax of teacher forcing; at share 0 it equals "
        "the causal model's greedy tokens; the `pretrained` variant equals the untouched model) and **merge** "
        "(`merge()` keeps logits within 1e-4 and greedy tokens identical) and, for models whose layers keep "
        "per-row states (recurrent, convolution), **states** (at share 0 the cache holds the causal pass's states "
        "exactly; a left-padded row equals its prompt alone on every prompt path; every state coefficient gets a "
        "gradient). The checks are "
        "`tests/helpers/architectures.py`; `pytest -m architectures` re-runs them all and compares with this page.",
        "",
        f"**{counts['pass']} of the {tested} types whose tiny model builds pass every check**; "
        f"{counts['refused']} are refused at wrap with the reason; {counts['fail']} are accepted with a failing "
        f"check; {counts['no_tiny']} could not be tested; {counts['out_of_scope']} are not decoder-only text LMs.",
        "",
        "What wrap checks on any model, listed here or not (`bitune.support`): every decoder layer is of a kind "
        "Bitune implements (`bitune.kinds`: full, sliding-window, local (GPT-Neo), chunked (Llama 4), ALiBi "
        "(Bloom, MPT) and indexed (DSA) attention, recurrent and convolution layers whose final states are mixed, "
        "attention and SSM side by side, MLP-only blocks; KV sharing, compressed (DeepSeek-V4) and "
        "relative-logit (Inkling) attention, caches of a layout of their own and models without any attention "
        "layer are refused with the reason), the bidirectional pass sees later tokens in every attention layer "
        "and the causal pass does not; "
        "then it keeps only the fast paths (prompt passes batched as one forward, everything fused into one "
        "forward) that the layers allow and that compute what the passes read one by one "
        "compute on this model. The *path* column is what wrap picked: training forward / prompt reading.",
        "",
        "**Find your model.** Its type is the `model_type` in its `config.json` (on the Hub: the model page's "
        "*Files* tab; in Python: `transformers.AutoConfig.from_pretrained(NAME).model_type`). A multimodal "
        "checkpoint names its text model's type under `text_config`. Search this page for the type, or for the "
        "model's name: the *models on the Hub* column names the families published under each type (e.g. "
        "Qwen3.5 -> `qwen3_5_text`, Llama 3 -> `llama`).",
        "",
        "| type | models on the Hub | model class | attention | status | path | note |",
        "|---|---|---|---|---|---|---|",
    ]
    order = ["pass", "fail", "refused", "no_tiny", "out_of_scope"]
    for model_type, r in sorted(rows.items(), key=lambda kv: (order.index(kv[1]["status"]), kv[0])):
        note = r.get("reason") or r.get("note") or ""
        if r["status"] == "fail":
            failed = {k: v for k, v in (r.get("checks") or {}).items() if v}
            note = "; ".join(f"{k}: {v}" for k, v in failed.items()) or note
        if r["status"] == "out_of_scope":
            note = _out_of_scope(model_type, r, rows) or note
        lines.append(f"| `{model_type}` | {FAMILIES.get(model_type, '')} | {r.get('model_class', '')} | "
                     f"{r.get('attn') or ''} | {r['status']} | {r.get('path', '')} | {_cell(note)} |")
    lines += ["", *REFUSED_HELP]
    bf16 = data.get("bfloat16", {})
    if bf16:
        lines += ["", "## In bfloat16", "",
                  "The popular types again in bfloat16 (mixing in float32), with bfloat16's tolerances (paths agree "
                  "within 3e-2, merged within 6e-2).", "",
                  "| type | status | note |", "|---|---|---|"]
        for model_type, r in sorted(bf16.items()):
            failed = {k: v for k, v in (r.get("checks") or {}).items() if v}
            note = "; ".join(f"{k}: {v}" for k, v in failed.items()) or r.get("reason", "")
            lines.append(f"| `{model_type}` | {r['status']} | {_cell(note)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="*", help="model types to (re-)run; default: all")
    parser.add_argument("--page", action="store_true", help="only render the page from the committed file")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the rendering")
    args = parser.parse_args()
    if args.check:
        ok = PAGE.read_text(encoding="utf-8") == render(json.loads(RESULTS.read_text(encoding="utf-8")))
        print("the page is current" if ok else f"{PAGE} is stale: run python scripts/architectures.py --page")
        return 0 if ok else 1
    if not args.page:
        sys.path.insert(0, str(ROOT / "tests"))
        sys.path.insert(0, str(ROOT / "src"))
        from helpers.architectures import causal_lm_types
        data = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.is_file() else {}
        data.setdefault("float32", {})
        data.setdefault("bfloat16", {})
        types = args.types or list(causal_lm_types())
        unknown = sorted(set(types) - set(causal_lm_types()))
        if unknown:
            parser.error(f"not causal-LM types of this transformers: {', '.join(unknown)}")
        if not args.types:
            data["float32"] = {}
        data["float32"].update(run_many(types))
        data["bfloat16"].update(run_many([t for t in types if t in BF16], "bfloat16"))
        data["versions"] = versions()
        write_json(RESULTS, data)
    PAGE.write_text(render(json.loads(RESULTS.read_text(encoding="utf-8"))), encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
