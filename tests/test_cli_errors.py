"""The CLI's one error boundary: every bad input is one ``bitune VERB: error: ...`` line naming what is wrong,
exit status 2, nothing half-written; an unexpected exception is one line pointing at ``--debug``; help and
settings validation do not import the model stack."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitune.cli import main
from gen_helpers import save_checkpoint


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
