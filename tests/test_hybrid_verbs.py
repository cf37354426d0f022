"""Every verb on models whose layers are of other kinds than the paper's attention, saved to a folder, as a user
brings their checkpoint: hybrids (a tiny Qwen3.5: Gated DeltaNet and attention layers; a tiny Nemotron-H: Mamba2,
attention and MLP-only layers) and attention of other kinds (Bloom: ALiBi; Llama 4: chunked, with chunks the prompts
cross; DeepSeek-V3.2: indexed). ``bitune train`` a few steps, ``eval``, ``generate``, ``chat``, ``serve`` (one
request through the official ``openai`` client) and ``export --merged`` (plain transformers loads it and decodes
the merged model's greedy tokens); what their layers rule out (compiled decoding, extending a conversation's cache)
is refused at start in one line."""

from __future__ import annotations

import io
import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from bitune.cli import main
from bitune.loading import load_bitune
from helpers.architectures import attn_for, tiny_model
from helpers.serve import serving
from helpers.tokenizer import tiny_tokenizer

TYPES = ["qwen3_5_text", "nemotron_h", "bloom", "llama4_text", "deepseek_v32"]


@pytest.fixture(scope="module", params=TYPES)
def trained(request, tmp_path_factory):
    """A tiny base folder of the type and a Bitune checkpoint `bitune train` made on it (3 steps)."""
    root = tmp_path_factory.mktemp(request.param)
    base = root / "base"
    tiny_model(request.param, attn_for(request.param) or "sdpa").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {w}", "output": f"{w} it is"}) + "\n"
                            for w in ("hi", "yes", "no", "ok", "red", "sky")))
    config = root / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(base), "dataset": str(data), "max_length": 64, "steps": 3,
                                      "batch_size": 2, "lr": 1e-2, "output_dir": str(root / "run"),
                                      "bitune": {"init_share": 0.3}}))
    assert main(["train", "--config", str(config)]) == 0
    return root, root / "run" / "final"


def test_train_writes_a_checkpoint_whose_state_coefficients_moved(trained):
    _, ckpt = trained
    model, _ = load_bitune(str(ckpt), device="cpu")
    ratios = model.mixing_ratios()
    moving = ("s", "c") if model.layer_kinds.stateful else ("k", "v")
    assert {"k", "v", *moving} <= set(ratios)
    start = torch.tensor(0.3)
    for name in moving:
        states = [i for i, k in enumerate(model.layer_kinds.kinds) if any(c == name for _, c in k.mix)]
        assert states and not torch.allclose(ratios[name][states], start, atol=1e-6), name


def test_generate_and_chat_answer(trained, tmp_path, monkeypatch, capsys):
    _, ckpt = trained
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "say hi", "--max-new-tokens", "4"]) == 0
    out = tmp_path / "chat.json"
    monkeypatch.setattr("sys.stdin", io.StringIO("say hi\nsay no\n/exit\n"))
    assert main(["chat", "--checkpoint", str(ckpt), "--max-new-tokens", "4", "--save", str(out)]) == 0
    assert len(json.loads(out.read_text())["messages"]) == 4  # two turns, each answered
    monkeypatch.setattr("sys.stdin", io.StringIO("say hi\nsay no\n/exit\n"))
    extends = load_bitune(str(ckpt), device="cpu")[0].layer_kinds.allows("extend") is None  # indexed layers do
    code = main(["chat", "--checkpoint", str(ckpt), "--mode", "alternating", "--max-new-tokens", "4"])
    assert code == (0 if extends else 2)
    assert extends or "--mode reread" in capsys.readouterr().err.strip().splitlines()[-1]


def test_eval_scores_every_question_without_packing(trained, tmp_path):
    _, ckpt = trained
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "arc_easy", "--limit", "4", "--output", str(out)]) == 0
    scores = json.loads(out.read_text())["tasks"]["arc_easy"]
    assert scores["n"] == 4 and 0 <= scores["acc"] <= 1


def test_serve_answers_the_openai_client(trained):
    openai = pytest.importorskip("openai")
    _, ckpt = trained
    with serving(ckpt) as (url, _, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="say hi", max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1


def test_export_merged_decodes_the_merged_models_greedy_tokens(trained, tmp_path):
    _, ckpt = trained
    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(out)]) == 0
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    model, tok = load_bitune(str(ckpt), device="cpu")
    ids = tok(["say hi"], return_tensors="pt").input_ids
    want = model.weights.base.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                       do_sample=False, pad_token_id=0)
    got = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(got, want)


def test_what_the_layers_rule_out_is_refused_at_start_in_one_line(trained, capsys):
    _, ckpt = trained
    model, _ = load_bitune(str(ckpt), device="cpu")
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="static cache"):
        model.generate(ids, mask, max_new_tokens=2, compile=True)
    _, state = model.generate(ids, mask, max_new_tokens=2, return_state=True)
    if model.layer_kinds.allows("extend") is not None:
        with pytest.raises(ValueError, match="reread"):
            model.generate(ids, mask, max_new_tokens=2, past=state)
    assert main(["serve", "--checkpoint", str(ckpt), "--compile", "--port", "0"]) == 2
    assert "without --compile" in capsys.readouterr().err.strip().splitlines()[-1]
