"""What the fifth set of unseen inputs broke (issue 65), one test per class: eager-only models from the CLI, dotted
config names, report.yaml names, sweep's resume checks, a declined merge at export, hints, PEFT's pattern noise on
MoE models, init_share's high end, and two eval processes writing one output."""

from __future__ import annotations

import json
import multiprocessing
import os
import warnings
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, BloomConfig, Gemma2Config, OpenAIGPTConfig

from bitune import BituneConfig, BituneModel
from bitune.cli import VERBS, main
from bitune.commands.sweep import parse_methods
from bitune.config_files import PACKAGED, resolve_config
from bitune.errors import BituneError
from bitune.files import write_text_atomic
from bitune.train import load_settings
from helpers.architectures import tiny_model as tiny_of_type
from helpers.gen import perturbed_bitune as tiny_bitune_on
from helpers.gen import save_checkpoint
from helpers.scripts import load_script
from helpers.tokenizer import tiny_tokenizer
from test_cli_errors import no_work, one_error_line  # noqa: F401 (no_work: a fixture)
from test_hardening import _eval_json, manifest

EAGER_ONLY = {  # model types that implement no sdpa attention: transformers' own default loads them with eager
    "gemma2": lambda: Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
                                   eos_token_id=1, bos_token_id=2),
    "bloom": lambda: BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0, eos_token_id=1,
                                 bos_token_id=2),
    "openai-gpt": lambda: OpenAIGPTConfig(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4),
}


@pytest.fixture(scope="module")
def eager_only(tmp_path_factory):
    """A tiny model of each eager-only type saved to a folder with the tiny tokenizer, as a user's model is."""
    root = tmp_path_factory.mktemp("eager")
    for name, config in EAGER_ONLY.items():
        AutoModelForCausalLM.from_config(config()).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root


# ------------------------------------------------------------------------------- A. eager-only models from the CLI
@pytest.mark.parametrize("name", ["gemma2", "bloom"])
def test_an_eager_only_model_the_page_lists_as_pass_runs_from_the_cli(eager_only, capsys, name):
    """gemma2 and bloom implement no sdpa: the CLI loaded them with sdpa and refused them as 'not a local folder with
    safetensors weights'; they load with eager, as transformers' own default does, and the passes build eager masks
    for them (bloom's ALiBi made symmetric at wrap)."""
    assert main(["generate", "--model", str(eager_only / name), "--prompt", "ab", "--template", "none",
                 "--max-new-tokens", "2"]) == 0, capsys.readouterr().err


def test_an_eager_only_refused_model_shows_its_real_reason(eager_only, tmp_path, capsys):
    """openai-gpt (GPT-1: its attention cannot take a prompt pass's 4D mask) is refused by Bitune's wrap checks:
    that reason, not a loading error, is what the user reads."""
    out = tmp_path / "run"
    assert main(["train", "--set", f"model={eager_only / 'openai-gpt'}", "--set", "steps=1", "--set", "max_length=64",
                 "--set", f"output_dir={out}"]) == 2
    line = one_error_line(capsys, "train")
    assert "OpenAIGPTLMHeadModel (openai-gpt) is not supported by Bitune: a prompt pass" in line, line
    assert not out.exists()


# ------------------------------------------------------------------------------- B. config names with a dot
def test_a_dotted_config_name_resolves_by_its_whole_text_and_a_local_file_comes_first(tmp_path, monkeypatch):
    """``methods/theta_0.01``: the '.01' was taken as a file extension, so a local ``methods/theta_0.01.yaml``
    lost to the packaged one."""
    monkeypatch.chdir(tmp_path)
    assert resolve_config("methods/theta_0.01") == PACKAGED / "methods" / "theta_0.01.yaml"
    assert resolve_config("study/part4/bitune_share0.1") == PACKAGED / "study" / "part4" / "bitune_share0.1.yaml"
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "theta_0.01.yaml").write_text("bitune:\n  theta_init: 0.02\n")
    assert resolve_config("methods/theta_0.01") == Path("methods/theta_0.01.yaml")


def test_sweep_labels_dotted_method_names_by_their_whole_name():
    """``--methods theta_0.01,theta_0.1`` was 'theta_0' twice; one alone wrote ``theta_0-42/``, and a later
    ``theta_0.1`` into the same folder was skipped as already evaluated."""
    methods = parse_methods("theta_0.01,theta_0.1,methods/theta_0.001.yaml")
    assert [m.label for m in methods] == ["theta_0.01", "theta_0.1", "theta_0.001"]
    assert [resolve_config(m.overlay).name for m in methods] == ["theta_0.01.yaml", "theta_0.1.yaml",
                                                                 "theta_0.001.yaml"]


# ------------------------------------------------------------------------------- G. hints
def test_an_extends_near_miss_suggests_the_packaged_config(tmp_path, capsys):
    (tmp_path / "task.yaml").write_text("extends: tasks/piqq\nsteps: 2\n")
    assert main(["train", "--config", str(tmp_path / "task.yaml"), "--dry-run"]) == 2
    assert "did you mean the packaged config tasks/piqa" in one_error_line(capsys, "train")


def test_a_method_near_miss_suggests_the_packaged_method_file():
    with pytest.raises(BituneError, match="did you mean 'bitune_clip_adapters'"):
        parse_methods("bitune_clip_adaptrs")


# ------------------------------------------------------------------------------- C. report.yaml names
@pytest.mark.parametrize("setting, text, named, hint", [
    ("pairs", "pairs: [[bitnue, lora]]\n", "bitnue", "bitune"),
    ("fair_baselines", "fair_baselines: [lora61]\n", "lora61", "lora16"),
    ("methods", "methods: [pretrained, lora, lroa16, bitune]\n", "lroa16", "lora16"),
])
def test_a_report_yaml_name_that_matches_no_run_is_refused(tmp_path, capsys, setting, text, named, hint):
    """A pair or a fair baseline naming no run dropped its comparison without a word; a misspelt method lost its
    place in the order. Checked against every run of the study, so a report of one of its folders still reads."""
    for label in ("pretrained", "lora", "lora16", "bitune"):
        _eval_json(tmp_path / "study" / "piqa" / f"{label}-42", label=label)
    (tmp_path / "study" / "report.yaml").write_text(text)
    before = manifest(tmp_path)
    assert main(["report", str(tmp_path / "study"), "--no-figure"]) == 2
    line = one_error_line(capsys, "report")
    assert f"{setting} names {named!r}" in line and f"did you mean {hint!r}" in line and "report.yaml" in line, line
    assert manifest(tmp_path) == before


def test_a_report_of_one_folder_of_a_study_checks_names_against_the_whole_study(tmp_path, capsys):
    for label, task in (("lora", "piqa"), ("bitune", "piqa"), ("lora_compute", "csqa"), ("bitune", "csqa")):
        _eval_json(tmp_path / "study" / task / f"{label}-42", label=label)
    (tmp_path / "study" / "report.yaml").write_text("fair_baselines: [lora_compute]\n")
    assert main(["report", str(tmp_path / "study" / "piqa"), "--no-figure"]) == 0, capsys.readouterr().err


# ------------------------------------------------------------------------------- D. sweep's resumed runs
@pytest.mark.usefixtures("no_work")
def test_sweep_checks_a_resumed_runs_settings_before_its_first_run(tmp_path, capsys):
    """An unfinished ``bitune-42`` saved at share 0.3, a sweep with ``--set bitune.init_share=0.2``: lora-42 was
    trained and evaluated first, then the sweep failed with advice about --resume, which the user never typed."""
    pytest.importorskip("lm_eval")
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "config.json").write_text("{}")
    config = tmp_path / "train.yaml"
    config.write_text(f"model: {tmp_path / 'base'}\nsteps: 4\n")
    run_dir = tmp_path / "sw" / "bitune-42"
    saved = load_settings([str(config)], ["bitune.variant=bitune", "bitune.init_share=0.3", "seed=42",
                                          f"output_dir={run_dir}"])
    (run_dir / "checkpoint-2").mkdir(parents=True)
    (run_dir / "checkpoint-2" / "trainer_state.json").write_text('{"step": 2}')
    (run_dir / "settings.yaml").write_text(saved.to_yaml())
    before = manifest(tmp_path)
    assert main(["sweep", "--config", str(config), "--methods", "lora,bitune", "--seeds", "42", "--tasks", "piqa",
                 "--limit", "2", "--set", "bitune.init_share=0.2", "--output-dir", str(tmp_path / "sw")]) == 2
    line = one_error_line(capsys, "sweep")
    assert str(run_dir) in line and "bitune.init_share (saved 0.3, now 0.2)" in line, line
    assert "--resume" not in line, line
    assert manifest(tmp_path) == before and not (tmp_path / "sw" / "lora-42").exists()


# ------------------------------------------------------------------------------- E. a declined merge at export
def test_export_merged_of_a_model_whose_merge_is_declined_names_the_reason(tmp_path, monkeypatch, capsys):
    """The error was 'merged_model() needs the causal set merged: call merge() first', advice for Python; the
    reason sat in a warning above it."""
    import bitune.probe

    ckpt, _ = save_checkpoint(tmp_path)
    note = "merge() declined: PEFT's merge of this model's adapted layers moves its logits by 0.5; it runs unmerged"

    monkeypatch.setattr(bitune.probe, "moved", lambda after, before: 0.5)  # PEFT's merge inexact (LongCat-Flash)
    before = manifest(tmp_path)
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(tmp_path / "exported")]) == 2
    line = one_error_line(capsys, "export")
    assert note.removeprefix("merge() declined: ") in line and "call merge()" not in line, line
    assert manifest(tmp_path) == before and not (tmp_path / "exported").exists()


def test_runs_on_as_many_but_other_questions_are_told_the_questions_differ(tmp_path, capsys):
    """Two runs with --limit 2 on different questions were told 'evaluated on 2 questions, other runs on 2
    (different --limit?)'."""
    _eval_json(tmp_path / "runs" / "lora-42")
    other = json.loads(_eval_json(tmp_path / "runs" / "bitune-42", label="bitune").read_text())
    other["samples"]["piqa"]["doc_id"] = [0, 5]
    (tmp_path / "runs" / "bitune-42" / "eval.json").write_text(json.dumps(other))
    assert main(["report", str(tmp_path / "runs"), "--no-figure"]) == 2
    line = one_error_line(capsys, "report")
    assert "different --limit" not in line and "other questions" in line and "doc_id 5" in line, line


# ------------------------------------------------------------------------------- H. PEFT's noise on MoE models
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_a_moe_model_wraps_without_peft_pattern_warnings(model_type):
    """PEFT's v4 -> v5 conversion gives the fused ``gate_up_proj`` experts rank and alpha patterns (2r, 2 alpha);
    they apply, but PEFT's check looks for them among module names (the experts are a parameter) and warned twice
    per adapter: 8 stderr lines on a 1-step run. Harmless: every adapted layer keeps the config's scaling, which the
    test checks too."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = BituneModel.wrap(tiny_of_type(model_type), BituneConfig(rank=4, lora_alpha=1))
    assert not [w for w in seen if "did not match any targeted module" in str(w.message)], \
        [str(w.message) for w in seen]
    layers = [m for m in model.modules() if hasattr(m, "r") and isinstance(m.r, dict) and "causal" in m.r]
    assert layers and all(m.r["causal"] in (4, 8) and m.scaling["causal"] == 0.25 for m in layers)


# ------------------------------------------------------------------------------- item 3: the recorded base model
def test_a_checkpoint_records_a_local_base_model_by_its_absolute_path(tmp_path, monkeypatch, capsys):
    """``base_model: ./tiny`` was recorded as given: ``generate --checkpoint /abs/ckpt`` from another folder failed
    with 'model folder ./tiny does not exist'."""
    save_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    model = tiny_bitune_on("./base")
    model.save_pretrained("ckpt2")
    recorded = json.loads((tmp_path / "ckpt2" / "bitune_config.json").read_text())["base_model"]
    assert recorded == str((tmp_path / "base").resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["generate", "--checkpoint", str(tmp_path / "ckpt2"), "--prompt", "ab", "--max-new-tokens", "1",
                 "--template", "none"]) == 0, capsys.readouterr().err


def test_a_missing_recorded_base_names_the_checkpoint_and_base(tmp_path, capsys):
    ckpt, _ = save_checkpoint(tmp_path)
    config = json.loads((ckpt / "bitune_config.json").read_text())
    config["base_model"] = str(tmp_path / "moved-away")
    (ckpt / "bitune_config.json").write_text(json.dumps(config))
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "ab"]) == 2
    line = one_error_line(capsys, "generate")
    assert str(tmp_path / "moved-away") in line and f"recorded in checkpoint {ckpt}" in line and "--base" in line, line


# ------------------------------------------------------------------------------- two eval processes, one output
def _write_many(path: str, n: int, errors, start) -> None:
    start.wait()  # both writers at once
    for i in range(n):
        try:
            write_text_atomic(Path(path), f"{i}\n" * 2000)
        except OSError as e:
            errors.put(f"{type(e).__name__}: {e}")


def test_two_processes_writing_one_file_atomically_both_succeed(tmp_path):
    """``eval --num-processes 2`` exited 1 once in three runs on a loaded machine: FileNotFoundError '.eval.json.tmp'
    -> 'eval.json'. Every writer used the same temporary name, so one renamed away the file the other was about to
    rename. Each writer has its own temporary file now; the last rename wins, whole."""
    context = multiprocessing.get_context("fork")  # the writers only write files
    errors, start = context.Queue(), context.Barrier(2)
    writers = [context.Process(target=_write_many, args=(str(tmp_path / "eval.json"), 300, errors, start))
               for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert not found and all(w.exitcode == 0 for w in writers), found[:3]
    assert (tmp_path / "eval.json").read_text() in (f"{299}\n" * 2000,) and sorted(os.listdir(tmp_path)) == ["eval.json"]


def test_only_the_process_that_wrote_the_result_refreshes_the_card(tmp_path, monkeypatch):
    """Under --num-processes every launched process refreshed the checkpoint's card, the ranks without a result too,
    each by a rename of its own: two writers of one file at the same time."""
    import bitune.eval.evaluate
    import bitune.modelcard

    pytest.importorskip("lm_eval")
    ckpt, _ = save_checkpoint(tmp_path)
    refreshed = []
    monkeypatch.setattr(bitune.modelcard, "refresh_evaluation", lambda folder: refreshed.append(folder))
    monkeypatch.setattr(bitune.eval.evaluate, "evaluate_run", lambda **kwargs: None)  # a rank other than 0
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "piqa", "--limit", "2"]) == 0
    assert refreshed == []


# ------------------------------------------------------------------------------- item 4: the Supported models page
def _page_row(page: str, model_type: str) -> str:
    return next(line for line in page.splitlines() if line.startswith(f"| `{model_type}` |"))


def test_the_supported_models_page_finds_a_model_by_its_name_and_says_what_to_do_if_refused():
    """Keyed by model_type without saying where a user finds theirs; no Hub names to search for; no 'if your model
    is refused'; the llama4 row named Llama4ForCausalLM but said 'a multimodal wrapper'."""
    script = load_script("architectures")
    matrix = json.loads((Path(script.ROOT) / "docs" / "supported-models.json").read_text())
    page = script.render(matrix)
    assert "`model_type` in its `config.json`" in page
    assert "Qwen3.5" in _page_row(page, "qwen3_5_text") and "Llama 3" in _page_row(page, "llama")
    llama4 = _page_row(page, "llama4")
    status = matrix["float32"]["llama4_text"]["status"]  # the text model's own row's status, pointed to
    assert "Llama4ForCausalLM" in llama4 and "wrapper" not in llama4 and f"`llama4_text` ({status})" in llama4
    refused = page[page.index("## If your model is refused"):]
    assert "--config methods/lora" in refused and "contributing.md" in refused


def test_the_page_shows_a_refusal_reason_whole():
    script = load_script("architectures")
    reason = "UnsupportedModelError: " + "a long reason, " * 40 + "and its end"
    row = {"model_type": "x", "model_class": "XForCausalLM", "attn": "sdpa", "status": "refused", "reason": reason}
    page = script.render({"float32": {"x": row}, "versions": {"transformers": "5", "peft": "0", "torch": "2"}})
    assert reason in _page_row(page, "x")


# ------------------------------------------------------------------------------- I. init_share's high end
@pytest.mark.parametrize("share", [0.9999999999, 1 - 2 ** -25])
def test_an_init_share_whose_mixing_ratio_saturates_is_refused_naming_the_usable_range(share, capsys):
    """0.9999999999 was accepted and stuck: theta about 1e8, a == 1.0 in float32, the mixer's gradient 0. The low
    end (1e-36) was already refused for the same reason; each place that checks a share checks it the same way."""
    from bitune.mixer import Mixer

    with pytest.raises(ValueError, match=rf"init_share={share!r} is too close to 1.*float32.*0\.99999994"):
        BituneConfig(init_share=share)
    with pytest.raises(ValueError, match="too close to 1"):
        Mixer(2, theta_init=0.01, init_share=share)
    assert main(["train", "--set", f"bitune.init_share={share!r}", "--dry-run"]) == 2
    assert f"init_share={share!r} is too close to 1" in one_error_line(capsys, "train")


def test_the_highest_usable_init_share_still_learns():
    from bitune.mixer import Mixer

    mixer = Mixer(1, theta_init=0.01, init_share=1 - 2 ** -24)
    a = mixer.ratios()["k"]
    assert a.item() < 1.0
    mixer.ratio(mixer.theta_k).sum().backward()
    assert mixer.theta_k.grad.item() > 0


def test_init_shares_default_and_range_live_in_one_place(tmp_path):
    """The default was 0.1 in config.py and 0.5 in mixer.py; the range was checked in config.py, mixer.py and
    plot.py."""
    import inspect

    from bitune.config import DEFAULT_INIT_SHARE
    from bitune.mixer import Mixer
    from bitune.plot import initial_ratio

    assert BituneConfig().init_share == DEFAULT_INIT_SHARE
    assert inspect.signature(Mixer).parameters["init_share"].default is inspect.Parameter.empty
    (tmp_path / "settings.yaml").write_text("bitune:\n  init_share: 0.9999999999\n")
    with pytest.raises(BituneError, match="too close to 1"):
        initial_ratio(tmp_path / "log.jsonl")


# ------------------------------------------------------------------------------- item 5: --threads, progress
def test_every_verb_that_runs_a_model_takes_threads():
    """export took no --threads, while getting started says every verb that runs a model does (89.7 s on a busy
    machine at the default threads, 10.7 s at one)."""
    import argparse
    import importlib

    for verb in ("train", "eval", "generate", "chat", "serve", "export", "quickstart", "sweep"):
        parser = argparse.ArgumentParser()
        importlib.import_module(VERBS[verb][0]).configure(parser)
        assert "--threads" in parser.format_help(), verb


def test_export_applies_threads_and_says_what_it_is_doing(tmp_path, capsys):
    import torch

    ckpt, _ = save_checkpoint(tmp_path)
    before = torch.get_num_threads()
    try:
        assert main(["export", "--checkpoint", str(ckpt), "--merged", str(tmp_path / "out"), "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert "bitune export: loading" in err and "bitune export: merging" in err, err


# ------------------------------------------------------------------------------- item 7: minor frictions
def test_configs_list_and_the_training_guide_give_alpaca_demos_true_size():
    """`configs list` said 999 rows, the training guide 985: the file holds 999, of which 985 are unique and used."""
    from bitune.config_files import describe
    from bitune.data.datasets import load_examples

    used = len(load_examples("alpaca_demo", "train")) + len(load_examples("alpaca_demo", "validation"))
    guide = (Path(PACKAGED).parents[2] / "docs" / "guides" / "training.md").read_text()
    assert f"{used} rows" in guide and f"{used} unique" in describe("instruct/alpaca_demo")


def test_a_run_that_ends_leaves_no_lock_file_behind(tmp_path):
    """A finished run kept run.lock holding a dead pid; the lock is the operating system's, the file only its handle."""
    from bitune.train.run_folder import LOCK_FILE, run_lock
    from bitune.train.trainer import run_training
    from helpers.train import make_trainer

    trainer, settings = make_trainer(tmp_path, steps=2)
    run_training(trainer, settings)
    assert (tmp_path / "run" / "final").is_dir() and not (tmp_path / "run" / LOCK_FILE).exists()
    with pytest.raises(RuntimeError):
        with run_lock(tmp_path / "other"):
            assert (tmp_path / "other" / LOCK_FILE).is_file()  # held: the file names the holder
            raise RuntimeError("the run failed")
    assert not (tmp_path / "other" / LOCK_FILE).exists()
