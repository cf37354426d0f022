"""The CLI's one error boundary: every bad input is one ``bitune VERB: error: ...`` line naming what is wrong,
exit status 2, nothing half-written; an unexpected exception is one line pointing at ``--debug``; help and
settings validation do not import the model stack."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitune.cli import main
from helpers.gen import save_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("cli"))


def one_error_line(capsys, verb: str) -> str:
    """The single error line a failed command printed (asserting there is exactly one and no traceback)."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"bitune {verb}: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["train", "--set", "lr=oops", "--dry-run"]])
def test_help_and_settings_validation_import_no_model_stack(argv):
    code = ("import sys\nfrom bitune.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'transformers', 'peft') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_only_the_command_line_imports_the_command_modules():
    """The library and the benchmarks sit below the verbs: none imports ``bitune.commands`` (a helper two floors
    need lives on the lower one)."""
    import ast

    import bitune

    package = Path(bitune.__file__).parent
    upward = []
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).parts
        if parts[0] in ("commands", "cli.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = (".".join(("bitune", *parts[:-1])[:len(parts) - node.level + 1]) if node.level else "")
                name = ".".join(p for p in (base, node.module or "") if p)
                names = [name] + [f"{name}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            upward += [f"{path.relative_to(package)}: {n}" for n in names if n.startswith("bitune.commands")]
    assert not upward


def test_help_shows_values_and_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert "VARIANTS" not in text and "DATASETS" not in text
    assert "naive_bidir" in text and "arc_challenge" in text  # the values themselves
    assert "--threads" in text and "(default: None)" not in text
    assert all(line.count("(default:") <= 1 for line in text.splitlines())


def test_unexpected_exception_is_one_line_and_debug_shows_the_traceback(monkeypatch, capsys):
    import bitune.commands.generate

    def broken(args):
        raise TypeError("an internal bug")

    monkeypatch.setattr(bitune.commands.generate, "run", broken)
    assert main(["generate", "--model", "x", "--prompt", "hi"]) == 1
    line = one_error_line(capsys, "generate")
    assert "TypeError: an internal bug" in line and "--debug" in line
    with pytest.raises(TypeError):
        main(["generate", "--model", "x", "--prompt", "hi", "--debug"])


@pytest.mark.parametrize("override, named", [
    ("bitune.rank=true", "bitune.rank"), ("bitune.target_modules=5", "target_modules"), ("lr=true", "lr"),
    ("lr=.nan", "lr"), ("weight_decay=.inf", "weight_decay"), ("max_grad_norm=nan", "max_grad_norm"),
    ("bitune.theta_init=.inf", "theta_init"), ("seed=-1", "seed"), ("steps=2.5", "steps")])
def test_dry_run_rejects_wrong_types_and_impossible_numbers(override, named, capsys):
    assert main(["train", "--set", override, "--dry-run"]) == 2
    assert named in one_error_line(capsys, "train")


def test_documented_placeholder_in_set_is_text(capsys):
    assert main(["train", "--set", "output_dir=runs/{variant}-{seed}", "--dry-run"]) == 0
    assert "output_dir: runs/bitune-42" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_output_dir_that_cannot_be_a_folder_is_refused_before_training(where, tmp_path, capsys):
    blocker = tmp_path / "taken"
    blocker.write_text("x")
    out = blocker if where == "file" else blocker / "run"
    assert main(["train", "--set", f"output_dir={out}", "--dry-run"]) == 2
    assert str(blocker) in one_error_line(capsys, "train")


def test_generate_output_paths_are_checked_before_any_answer(saved, tmp_path, monkeypatch, capsys):
    ckpt, _ = saved
    import bitune.commands.generate

    monkeypatch.setattr(bitune.commands.generate, "generate_texts", lambda *a, **k: pytest.fail("answers computed"))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    (tmp_path / "file").write_text("x")
    for bad in (tmp_path, tmp_path / "file" / "out.jsonl"):
        assert main(["generate", "--checkpoint", str(ckpt), "--input", str(prompts), "--output", str(bad)]) == 2
        assert "--output" in one_error_line(capsys, "generate")
    assert not list(tmp_path.rglob("*.tmp"))


def test_an_output_never_overwrites_the_input_or_the_checkpoint(saved, tmp_path, monkeypatch, capsys):
    ckpt, _ = saved
    import bitune.commands.generate

    monkeypatch.setattr(bitune.commands.generate, "generate_texts", lambda *a, **k: pytest.fail("answers computed"))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    kept = {p: p.read_bytes() for p in [prompts, *Path(ckpt).rglob("*")] if p.is_file()}
    same = tmp_path / "sub" / ".." / "in.jsonl"  # the input under another spelling
    for out, named in ((same, "would overwrite --input"), (Path(ckpt) / "mixer.safetensors", "inside the checkpoint"),
                       (Path(ckpt) / "answers.jsonl", "inside the checkpoint")):
        (tmp_path / "sub").mkdir(exist_ok=True)
        assert main(["generate", "--checkpoint", str(ckpt), "--input", str(prompts), "--output", str(out)]) == 2
        assert named in one_error_line(capsys, "generate")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--checkpoint", str(ckpt), "--save", str(Path(ckpt) / "bitune_config.json")]) == 2
    assert "inside the checkpoint" in one_error_line(capsys, "chat")
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "piqa", "--output",
                 str(Path(ckpt) / "bitune_config.json")]) == 2
    assert "would overwrite a file of the checkpoint" in one_error_line(capsys, "eval")
    assert {p: p.read_bytes() for p in kept} == kept


def test_chat_save_path_is_checked_before_the_chat(saved, tmp_path, monkeypatch, capsys):
    ckpt, _ = saved
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["chat", "--checkpoint", str(ckpt), "--save", str(tmp_path / "file" / "c.json")]) == 2
    assert str(tmp_path / "file") in one_error_line(capsys, "chat")


def test_undecodable_text_is_named_wherever_it_comes_from(saved, tmp_path, monkeypatch, capsys):
    ckpt, _ = saved
    bad_bytes = tmp_path / "bytes.jsonl"
    bad_bytes.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff"}\n')
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"prompt": "ok"}\n{"prompt": "x\\ud800"}\n')
    for path, named in ((bad_bytes, "line 2"), (surrogate, ":2")):
        assert main(["generate", "--checkpoint", str(ckpt), "--input", str(path), "--device", "cpu"]) == 2
        line = one_error_line(capsys, "generate")
        assert str(path) in line and named in line and "UTF-8" in line
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "a\udcff", "--device", "cpu"]) == 2
    assert "--prompt" in one_error_line(capsys, "generate")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe\n"), encoding="utf-8"))
    assert main(["chat", "--checkpoint", str(ckpt), "--device", "cpu", "--max-new-tokens", "2"]) == 2
    assert "stdin line 1" in one_error_line(capsys, "chat")
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "\\udc80", "output": "b"}\n')
    assert main(["train", "--set", f"dataset={data}", "--dry-run"]) == 2
    line = one_error_line(capsys, "train")
    assert str(data) in line and "row 2" in line


def test_jsonl_rows_are_numbered_by_line_in_every_error(tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    for bad, problem in (("not json", "not valid JSON"), ('{"instruction": 5, "output": "b"}', "instruction")):
        data.write_text('{"instruction": "a", "output": "b"}\n\n' + bad + "\n")
        assert main(["train", "--set", f"dataset={data}", "--dry-run"]) == 2
        line = one_error_line(capsys, "train")
        assert "row 3" in line and problem in line, line


def test_bad_model_options_are_named(saved, tmp_path, capsys):
    ckpt, _ = saved
    cases = [(["--dtype", "int8"], "dtype 'int8'"), (["--device", "gpu"], "--device 'gpu'"),
             (["--top-p", "1.5", "--do-sample"], "--top-p"), (["--temperature", "nan", "--do-sample"], "--temperature")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "--device cuda"))
    for extra, named in cases:
        assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", *extra]) == 2
        assert named in one_error_line(capsys, "generate")


def test_checkpoint_config_of_the_wrong_type_names_the_file(saved, tmp_path, capsys):
    ckpt, _ = saved
    bad = tmp_path / "ckpt"
    bad.mkdir()
    config = json.loads((ckpt / "bitune_config.json").read_text())
    (bad / "bitune_config.json").write_text(json.dumps({**config, "base_model": 5}))
    assert main(["generate", "--checkpoint", str(bad), "--prompt", "hi", "--device", "cpu"]) == 2
    line = one_error_line(capsys, "generate")
    assert "bitune_config.json" in line and "base_model" in line


def test_unknown_model_offline_fails_at_once(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["generate", "--model", "someone/no-such-model", "--prompt", "hi"]) == 2
    assert "'someone/no-such-model'" in one_error_line(capsys, "generate")
    assert main(["generate", "--model", "no such model!", "--prompt", "hi"]) == 2
    assert "not a built-in" in one_error_line(capsys, "generate")


def test_prompt_longer_than_the_model_positions_is_refused(saved, capsys):
    ckpt, _ = saved
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "ab " * 80, "--device", "cpu"]) == 2
    line = one_error_line(capsys, "generate")
    assert "128" in line and "tokens" in line  # the tiny model reads 128 positions


def test_threads_is_applied_and_checked(saved, capsys):
    ckpt, _ = saved
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--threads", "0"]) == 2
    assert "--threads" in one_error_line(capsys, "generate")
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2",
                 "--device", "cpu", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1


def test_eval_silences_lm_eval_noise_outside_a_git_checkout(tmp_path, monkeypatch, capfd, caplog):
    import logging

    from lm_eval import evaluator

    from bitune.eval.evaluate import quiet_lm_eval

    monkeypatch.chdir(tmp_path)  # not a git checkout: git would print "fatal: not a git repository"
    with quiet_lm_eval(), caplog.at_level(logging.WARNING):
        assert evaluator.get_git_commit_hash() is None
        logging.getLogger("lm_eval.api.task").warning("piqa: Custom kwargs can be passed to `--metadata` in console")
        logging.getLogger("lm_eval.api.task").warning("a warning of substance")
    assert "fatal" not in capfd.readouterr().err
    assert [r.getMessage() for r in caplog.records] == ["a warning of substance"]
    assert evaluator.get_git_commit_hash.__module__ == "lm_eval.loggers.utils"  # restored afterwards


@pytest.mark.parametrize("argv, prog", [
    (["nosuchverb"], "bitune"), (["generate", "--prompt", "x"], "bitune generate"),  # --checkpoint/--model missing
    (["train", "--num-processes", "x"], "bitune train"), (["eval", "--bogus"], "bitune eval"),
    (["plot"], "bitune plot"), (["bench", "nope"], "bitune bench"), (["plot", "mixing"], "bitune plot mixing")])
def test_a_bad_command_line_is_one_line_with_help_advice(argv, prog, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    assert err.startswith(f"{prog}: error: ") and err.endswith(f"; see {prog} --help\n"), err


# ------------------------------------------------------------------ the inputs a careful user still gets wrong
def run_folder(ckpt: Path, root: Path) -> Path:
    """A run folder ``root`` whose ``final/`` holds the checkpoint's config and mixer (what the verbs read first)."""
    (root / "final").mkdir(parents=True)
    for name in ("bitune_config.json", "mixer.safetensors"):
        (root / "final" / name).write_bytes((ckpt / name).read_bytes())
    return root


def _run(argv, capsys, verb=None) -> str:
    """Run ``bitune ARGV``, assert the failure is one error line with exit status 2, and return the line."""
    assert main(argv) == 2
    return one_error_line(capsys, verb or argv[0])


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command gets as far as generating, evaluating or training."""
    import bitune.commands.generate
    import bitune.commands.sweep
    import bitune.eval.evaluate

    def fail(*a, **k):
        pytest.fail("the command ran before refusing its input")

    monkeypatch.setattr(bitune.commands.generate, "generate_texts", fail)
    monkeypatch.setattr(bitune.eval.evaluate, "evaluate", fail)
    monkeypatch.setattr(bitune.commands.sweep, "evaluate_run", fail)
    monkeypatch.setattr(bitune.commands.sweep, "train_run", fail)


EVAL_RECORD = {"schema": "bitune-eval/1", "label": "lora", "tasks": {"piqa": {"acc": 0.5}},
               "config": {"train_seed": 42, "limit": None}}
"""A minimal ``bitune eval`` result, for ``bitune report``."""

EMPTY_PATHS = [  # (argv with {ckpt} and {p} for the empty or blank path, the option named)
    (["generate", "--checkpoint", "{ckpt}", "--input", "{p}"], "--input"),
    (["generate", "--checkpoint", "{ckpt}", "--input", "{input}", "--output", "{p}"], "--output"),
    (["generate", "--checkpoint", "{p}", "--prompt", "hi"], "--checkpoint"),
    (["generate", "--checkpoint", "{ckpt}", "--base", "{p}", "--prompt", "hi"], "--base"),
    (["chat", "--checkpoint", "{ckpt}", "--save", "{p}"], "--save"),
    (["plot", "mixing", "--log", "{p}", "--output", "figs"], "--log"),
    (["plot", "mixing", "--log", "{input}", "--output", "{p}"], "--output"),
    (["eval", "--checkpoint", "{p}", "--tasks", "piqa"], "--checkpoint"),
    (["eval", "--checkpoint", "{ckpt}", "--tasks", "piqa", "--output", "{p}"], "--output"),
    (["report", "{p}"], "RUN"),
    (["report", "{runs}", "--output", "{p}"], "--output"),
    (["report", "{runs}", "--output", "out", "--embed", "{p}"], "--embed"),
    (["export", "--checkpoint", "{ckpt}", "--merged", "{p}"], "--merged"),
    (["train", "--config", "{p}", "--dry-run"], "config file"),
    (["sweep", "--config", "{config}", "--methods", "pretrained", "--tasks", "piqa", "--output-dir", "{p}"],
     "--output-dir"),
    (["quickstart", "--output-dir", "{p}"], "--output-dir"),
]


@pytest.mark.parametrize("blank", ["", " "])
@pytest.mark.parametrize("argv, named", EMPTY_PATHS)
def test_an_empty_or_blank_path_is_named_and_never_means_the_current_folder(argv, named, blank, saved, tmp_path,
                                                                            monkeypatch, capsys, no_work):
    """``Path("")`` is the current folder and ``" "`` a file called " ": neither is what the user meant to name
    (an empty shell variable); before, ``--merged ""`` replaced the current folder, ``--output ""`` wrote to stdout
    or into the checkpoint, ``--base ""`` loaded the recorded base and ``--output " "`` wrote a file named " "."""
    ckpt, _ = saved
    work = tmp_path / "cwd"
    work.mkdir()
    (work / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (work / "train.yaml").write_text(f"model: {ckpt.parent / 'base'}\n")
    (work / "runs" / "lora-42").mkdir(parents=True)
    (work / "runs" / "lora-42" / "eval.json").write_text(json.dumps(EVAL_RECORD))
    monkeypatch.chdir(work)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    before = sorted(p.name for p in work.iterdir())
    argv = [a.format(ckpt=ckpt, p=blank, input=work / "in.jsonl", runs=work / "runs", config=work / "train.yaml")
            for a in argv]
    line = _run(argv, capsys)
    assert named in line and ("is empty" in line or "is blank" in line), line
    assert sorted(p.name for p in work.iterdir()) == before  # nothing written where the user stands


@pytest.mark.parametrize("case", ["generate", "chat", "eval", "eval_folder"])
def test_an_output_never_overwrites_the_base_model(case, saved, capsys, monkeypatch, no_work):
    """The base model a command loads (--model, --base, or the one the checkpoint records) is an input too."""
    ckpt, _ = saved
    base = ckpt.parent / "base"
    kept = {p: p.read_bytes() for p in base.rglob("*") if p.is_file()}
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    argv = {"generate": ["generate", "--checkpoint", str(ckpt), "--input", str(ckpt.parent / "in.jsonl"),
                         "--output", str(base / "config.json")],
            "chat": ["chat", "--model", str(base), "--save", str(base / "tokenizer.json")],
            "eval": ["eval", "--checkpoint", str(ckpt), "--base", str(base), "--tasks", "piqa",
                     "--output", str(base / "config.json")],
            "eval_folder": ["eval", "--checkpoint", str(ckpt), "--tasks", "piqa", "--output", str(base)]}[case]
    (ckpt.parent / "in.jsonl").write_text('{"prompt": "hi"}\n')
    line = _run(argv, capsys)
    assert str(base) in line and "must stay as it is" in line
    assert {p: p.read_bytes() for p in kept} == kept


@pytest.mark.parametrize("target", ["current_folder", "run", "base_model", "file", "other_files"])
def test_export_replaces_only_a_new_empty_or_exported_folder(target, saved, tmp_path, monkeypatch, capsys):
    """--merged is replaced whole: a folder that holds anything else (a run, the base model, the user's files, the
    current folder) is refused with what it holds, before anything loads, and left as it was."""
    ckpt, _ = saved
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "log.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "precious.txt").write_text("mine")
    monkeypatch.chdir(run)
    merged = {"current_folder": ".", "run": str(run), "base_model": str(ckpt.parent / "base"),
              "file": str(tmp_path / "notes.txt"), "other_files": str(tmp_path / "other")}[target]
    kept = {p: p.read_bytes() for p in [*tmp_path.rglob("*"), *(ckpt.parent / "base").rglob("*")] if p.is_file()}
    line = _run(["export", "--checkpoint", str(ckpt), "--merged", merged], capsys)
    assert "--merged" in line and any(s in line for s in ("holds other files", "is a file", "must stay as it is")), line
    assert {p: p.read_bytes() for p in kept} == kept
    assert (run / "final").is_dir()


def test_export_still_replaces_an_earlier_export(saved, tmp_path):
    ckpt, _ = saved
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(out)]) == 0
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(out)]) == 0
    assert (out / "config.json").is_file() and (out / "bitune" / "bitune_config.json").is_file()


NEAR_MISSES = [  # (argv, what the error suggests)
    (["train", "--set", "bitune.variant=bitnue", "--dry-run"], "did you mean 'bitune'"),
    (["train", "--set", "bitune.method=lroa", "--dry-run"], "did you mean 'lora'"),
    (["train", "--set", "dataset=alpaca_dem", "--dry-run"], "did you mean 'alpaca_demo'"),
    (["train", "--set", "model=smollm2-135", "--dry-run"], "did you mean the built-in 'smollm2-135m'"),
    (["train", "--set", "model={ckpt}", "--dry-run"], "is a Bitune checkpoint, not a base model"),
    (["train", "--config", "{root}/task.yml", "--dry-run"], "did you mean {root}/task.yaml"),
    (["eval", "--checkpoint", "{ckpt}", "--tasks", "arc-challenge"], "did you mean 'arc_challenge'"),
    (["sweep", "--methods", "lroa16", "--output-dir", "{root}/sweep"], "did you mean 'lora16'"),
    (["generate", "--checkpoint", "{root}", "--prompt", "hi"], "did you mean {ckpt}, the checkpoint in it"),
    (["generate", "--model", "{ckpt}", "--prompt", "hi"], "is a Bitune checkpoint, not a base model"),
    (["generate", "--checkpoint", "{ckpt}", "--base", "{ckpt}", "--prompt", "hi"], "is a Bitune checkpoint"),
    (["plot", "mixing", "--log", "{root}", "--output", "{root}/figs"], "did you mean {root}/log.jsonl"),
    (["report", "{root}/runs", "--baselines", "lroa", "--no-figure"], "did you mean 'lora'"),
]


@pytest.mark.parametrize("argv, hint", NEAR_MISSES)
def test_a_near_miss_name_suggests_the_right_one(argv, hint, saved, tmp_path, capsys, no_work):
    """A misspelt name, a run folder for its checkpoint or log, a checkpoint for a base model: the error says what
    was probably meant (before, several were accepted until the command failed later, or named nothing)."""
    ckpt, _ = saved
    root = run_folder(ckpt, tmp_path / "run")
    (root / "log.jsonl").write_text('{"step": 1, "a_k": [0.5, 0.5], "a_v": [0.5, 0.5]}\n')
    (root / "task.yaml").write_text("lr: 1e-3\n")
    (root / "runs" / "lora-42").mkdir(parents=True)
    (root / "runs" / "lora-42" / "eval.json").write_text(json.dumps(EVAL_RECORD))
    fill = {"ckpt": root / "final" if "{ckpt}, the" in hint else ckpt, "root": root}
    line = _run([a.format(**fill) for a in argv], capsys)
    assert hint.format(**fill) in line, line


def test_a_yaml_key_written_twice_is_refused(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys without a word (YAML allows none): the first lr would be ignored."""
    config = tmp_path / "task.yaml"
    config.write_text("lr: 1e-3\nsteps: 5\nbitune:\n  rank: 4\nlr: 3e-4\n")
    line = _run(["train", "--config", str(config), "--dry-run"], capsys)
    assert str(config) in line and "key 'lr' appears twice" in line and "line 5" in line
    from bitune.train.settings import read_yaml

    config.write_text("a: &a {lr: 0.001, steps: 5}\nb:\n  <<: *a\n  steps: 6\n")  # a merge key may be overridden
    assert read_yaml(config) == {"a": {"lr": 0.001, "steps": 5}, "b": {"lr": 0.001, "steps": 6}}


@pytest.mark.parametrize("damage, named", [
    (lambda ckpt: (ckpt.parent / "settings.yaml").write_text("seed: [42\n"), "not valid YAML"),
    (lambda ckpt: (ckpt.parent / "settings.yaml").write_text("- 42\n"), "not the settings of a 'bitune train' run"),
    (lambda ckpt: (ckpt.parent / "settings.yaml").write_bytes(b"seed: 42\n# \xff\n"), "not UTF-8"),
])
def test_eval_refuses_a_damaged_run_settings_file_before_evaluating(damage, named, saved, tmp_path, capsys,
                                                                    no_work):
    """eval reads the training seed from the run's settings.yaml: a damaged one was an unexpected error (exit 1)
    after the whole evaluation; now it is named before anything loads."""
    ckpt, _ = saved
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    for p in ckpt.iterdir():
        if p.is_file():
            (run / "final" / p.name).write_bytes(p.read_bytes())
        else:
            (run / "final" / p.name).mkdir()
            for q in p.iterdir():
                (run / "final" / p.name / q.name).write_bytes(q.read_bytes())
    damage(run / "final")
    line = _run(["eval", "--checkpoint", str(run / "final"), "--tasks", "piqa", "--output", str(tmp_path / "e.json")],
                capsys)
    assert str(run / "settings.yaml") in line and named in line


def test_damaged_base_model_weights_are_a_user_error(saved, tmp_path, capsys):
    """A truncated model.safetensors in a base model folder was an unexpected SafetensorError (exit 1)."""
    ckpt, _ = saved
    base = tmp_path / "base"
    base.mkdir()
    for p in (ckpt.parent / "base").iterdir():
        base.joinpath(p.name).write_bytes(p.read_bytes()[:200] if p.name == "model.safetensors" else p.read_bytes())
    line = _run(["generate", "--model", str(base), "--prompt", "hi", "--device", "cpu"], capsys)
    assert str(base) in line and "deserializing header" in line


def test_a_damaged_training_log_is_named_or_kept_on_resume(tmp_path):
    """Resuming cuts the log back to the checkpoint's step: a line that is no step's record is kept as it is
    (it was an AttributeError, exit 1), undecodable bytes are named with the file."""
    from bitune.errors import BituneError
    from bitune.train.run_folder import truncate_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n[1, 2]\n{"step": 3}\n{"step": "x"}\n{"step": 2, "lo')
    truncate_log(log, 2)
    assert log.read_text() == '{"step": 1}\n[1, 2]\n{"step": "x"}\n'
    log.write_bytes(b'{"step": 1}\n\xff\n')
    with pytest.raises(BituneError, match=f"training log {log}: not UTF-8 text"):
        truncate_log(log, 2)


@pytest.mark.parametrize("argv, named", [
    (["generate", "--checkpoint", "{ckpt}", "--prompt", "hi", "--seed", "-1"], "--seed -1"),
    (["chat", "--checkpoint", "{ckpt}", "--seed", "4294967296"], "--seed 4294967296"),
    (["quickstart", "--seed", "-1", "--output-dir", "{tmp}/qs"], "--seed -1"),
    (["generate", "--checkpoint", "{ckpt}", "--input", "{tmp}/in.jsonl", "--batch-size", "0"], "--batch-size 0"),
    (["sweep", "--config", "{tmp}/train.yaml", "--methods", "pretrained,lora", "--seeds", "42,-1", "--tasks",
      "piqa", "--output-dir", "{tmp}/sweep"], "--seeds: -1"),
    (["sweep", "--config", "{tmp}/train.yaml", "--methods", "lora", "--seeds", "42", "--tasks", "piqa", "--device",
      "gpu", "--output-dir", "{tmp}/sweep"], "--device 'gpu'"),
])
def test_a_bad_number_or_device_is_named_before_anything_runs(argv, named, saved, tmp_path, capsys, monkeypatch,
                                                              no_work):
    """A negative seed was numpy's "Seed must be between 0 and 2**32 - 1" (naming no option); a sweep found a bad
    seed or --device only after evaluating or training the runs before it."""
    ckpt, _ = saved
    (tmp_path / "in.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "train.yaml").write_text(f"model: {ckpt.parent / 'base'}\n")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    line = _run([a.format(ckpt=ckpt, tmp=tmp_path) for a in argv], capsys)
    assert named in line, line
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow
def test_num_processes_damaged_run_settings_is_one_line_exit_2(saved, tmp_path):
    """The multi-process path: every launched process finds the damaged settings.yaml; one line, once, exit 2."""
    ckpt, _ = saved
    run = run_folder(ckpt, tmp_path / "run")
    (run / "settings.yaml").write_text("seed: [42\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bitune.cli", "eval", "--num-processes", "2", "--checkpoint", str(run / "final"),
           "--tasks", "piqa", "--limit", "2", "--device", "cpu", "--output", str(tmp_path / "e.json")]
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert job.returncode == 2, job.stderr
    lines = [x for x in job.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("bitune eval: error: ") and "settings.yaml" in lines[0], job.stderr
    assert not (tmp_path / "e.json").exists()
