"""What unseen inputs must not break (issue 41), one test per class, each over the members found in the code:
nothing another artefact needs or the command did not write is replaced or deleted (byte-identical manifests);
no crash where an error is due (also on a core install without the extras); no server that starts and cannot
serve; every error names what the user gave."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bitune.cli import EXTRAS, VERBS, main
from helpers.gen import save_checkpoint
from helpers.models import perturb_adapters, tiny_bitune
from test_cli_errors import one_error_line


def manifest(*folders: Path) -> dict[str, str]:
    """``path -> sha256`` of every file under ``folders`` (and the folders' entries, so an added file shows)."""
    out = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ------------------------------------------------------------------------------- 1. data replaced or deleted
@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """``base`` (a plain model) <- ``ckpt`` (a checkpoint) exported to ``exported`` <- ``on_export`` (a checkpoint
    trained on that export): the folders an export must never replace."""
    root = tmp_path_factory.mktemp("chain")
    ckpt, _ = save_checkpoint(root)
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(root / "exported")]) == 0
    on_export = perturb_adapters(tiny_bitune(base_model=str(root / "exported")))
    on_export.save_pretrained(root / "on_export")
    return root


@pytest.mark.parametrize("argv, named", [
    (["--checkpoint", "{on_export}", "--merged", "{exported}"], "the checkpoint's base model"),  # the case
    (["--checkpoint", "{ckpt}", "--merged", "{exported}", "--base", "{exported}"], "--base"),
    (["--checkpoint", "{on_export}", "--merged", "{base}"], "the base model of"),  # the base of the base
    (["--checkpoint", "{ckpt}", "--merged", "{root}"], "overlaps"),  # a folder around what it needs
    (["--checkpoint", "{on_export}", "--merged", "{exported}/sub"], "is inside"),
], ids=["recorded-base", "given-base", "base-of-base", "around", "inside"])
def test_export_never_replaces_what_a_checkpoint_needs(chain, argv, named, capsys):
    names = {"root": chain, "base": chain / "base", "ckpt": chain / "ckpt", "exported": chain / "exported",
             "on_export": chain / "on_export"}
    before = manifest(chain)
    assert main(["export", *(a.format(**names) for a in argv)]) == 2
    assert named in one_error_line(capsys, "export")
    assert manifest(chain) == before


def test_export_keeps_the_users_own_files_and_says_so(chain, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(chain / "ckpt"), "--merged", str(out)]) == 0
    (out / "README.md").write_text("my notes on this export\n")
    (out / "eval").mkdir()
    (out / "eval" / "scores.txt").write_text("0.51\n")
    mine = manifest(out / "eval") | {str(out / "README.md"): manifest(out)[str(out / "README.md")]}
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(chain / "ckpt"), "--merged", str(out)]) == 0
    assert "kept README.md, eval" in capsys.readouterr().out
    after = manifest(out)
    assert {k: after.get(k) for k in mine} == mine and (out / "config.json").is_file()


def test_eval_output_replaces_an_earlier_result_only(chain, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "data"}\n')
    before = manifest(tmp_path, chain)
    assert main(["eval", "--checkpoint", str(chain / "ckpt"), "--tasks", "piqa", "--output", str(mine)]) == 2
    assert "not an evaluation result" in one_error_line(capsys, "eval")
    assert manifest(tmp_path, chain) == before


OUTPUTS = {  # an option that writes a file: the command line (before anything loads), what it replaces
    "generate": (["generate", "--model", "{base}", "--input", "{prompts}", "--output", "{out}"],
                 "answers written by bitune generate"),
    "chat": (["chat", "--model", "{base}", "--save", "{out}"], "a conversation saved by bitune chat"),
    "bench": (["bench", "train", "--model", "{base}", "--output", "{out}"], "a benchmark record"),
}


@pytest.mark.parametrize("verb", OUTPUTS)
@pytest.mark.parametrize("mine", ["notes.jsonl", "notes.json", "prompts"])
def test_an_output_file_replaces_only_an_earlier_output_of_its_kind(chain, tmp_path, monkeypatch, capsys, verb, mine):
    """A file of the user's (their notes, even the prompts file the command reads) at --output/--save is refused
    with one line naming the option, the file and the way on, before the model loads; nothing changes."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    out = prompts if mine == "prompts" else tmp_path / mine
    if mine != "prompts":
        out.write_text('{"my": "data"}\n')
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("hello\n"))
    argv, kind = OUTPUTS[verb]
    before = manifest(tmp_path, chain)
    assert main([a.format(base=chain / "base", prompts=prompts, out=out) for a in argv]) == 2
    line = one_error_line(capsys, verb)
    assert str(out) in line and ("would overwrite --input" in line if (verb, mine) == ("generate", "prompts")
                                 else f"is not {kind}" in line and "move it away first" in line), line
    assert manifest(tmp_path, chain) == before


@pytest.mark.parametrize("verb", ["chat", "bench"])
def test_an_output_file_never_lies_inside_the_model_it_reads(chain, capsys, verb):
    before = manifest(chain)
    argv, _ = OUTPUTS[verb]
    out = chain / "base" / "notes.json"
    assert main([a.format(base=chain / "base", prompts="", out=out) for a in argv]) == 2
    assert f"is inside --model {chain / 'base'}" in one_error_line(capsys, verb)
    assert manifest(chain) == before


def test_generate_replaces_its_earlier_answers(chain, tmp_path, capsys):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    argv = ["generate", "--checkpoint", str(chain / "ckpt"), "--input", str(prompts), "--output", str(out),
            "--max-new-tokens", "2"]
    assert main(argv) == 0
    out.write_text(out.read_text().replace('"output": ', '"earlier": 1, "output": '))
    assert main(argv) == 0 and '"earlier"' not in out.read_text()


def _train_config(tmp_path: Path, run: Path, model: Path, data: Path) -> Path:
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model": str(model), "dataset": str(data), "output_dir": str(run), "steps": 1,
                                  "batch_size": 1, "grad_accum": 1, "max_length": 32, "log_every": 1}))
    return config


def _old_run(chain, run: Path) -> None:
    """A finished run in ``run``: what ``--overwrite`` deletes."""
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}\n")
    (run / "checkpoint-2").mkdir()
    (run / "log.jsonl").write_text('{"step": 1, "loss": 1.0}\n')


@pytest.mark.parametrize("model_in, data_in", [("final/base", "data.jsonl"), ("base", "checkpoint-2/data.jsonl"),
                                               ("final", "checkpoint-2/data.jsonl")])
def test_train_overwrite_never_deletes_its_own_base_model_or_data(chain, tmp_path, capsys, model_in, data_in):
    import shutil

    run = tmp_path / "run"
    _old_run(chain, run)
    shutil.copytree(chain / "base", run / model_in, dirs_exist_ok=True)
    (run / data_in).write_text('{"instruction": "a", "output": "b"}\n')
    config = _train_config(tmp_path, run, run / model_in, run / data_in)
    before = manifest(tmp_path)
    assert main(["train", "--config", str(config), "--overwrite"]) == 2
    line = one_error_line(capsys, "train")
    assert "which a run writes" in line and ("model=" if model_in != "base" else "dataset=") in line, line
    assert manifest(tmp_path) == before


def test_train_overwrite_keeps_what_a_run_did_not_write_and_says_so(chain, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    _old_run(chain, run)
    shutil.copytree(chain / "base", run / "base")
    (run / "data.jsonl").write_text('{"instruction": "a", "output": "b"}\n')
    (run / "NOTES.md").write_text("my notes\n")
    config = _train_config(tmp_path, run, run / "base", run / "data.jsonl")
    mine = manifest(run / "base") | {str(run / n): manifest(run)[str(run / n)] for n in ("data.jsonl", "NOTES.md")}
    capsys.readouterr()
    assert main(["train", "--config", str(config), "--overwrite"]) == 0
    assert "kept NOTES.md, base, data.jsonl" in capsys.readouterr().err
    after = manifest(run)
    assert {k: after.get(k) for k in mine} == mine and not (run / "checkpoint-2").exists()
    assert len(list((run / "final").iterdir())) > 1  # the new run's checkpoint, not the old stand-in


# ------------------------------------------------------------------------------- 2. crashes instead of errors
BLOCKER = """
import sys
from importlib.machinery import PathFinder
BLOCKED = set(sys.argv[1].split(","))
class Blocked(PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in BLOCKED else PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [Blocked if f is PathFinder else f for f in sys.meta_path]
"""

CORE_RUN = """
import contextlib, io, json, sys
from bitune.cli import main
results = []
for argv in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    results.append([code, err.getvalue()])
print("RESULTS" + json.dumps(results))
"""

NEEDS = [(["eval", "--model", "x"], "eval"), (["sweep", "--output-dir", "{tmp}/sweep"], "eval"),
         (["quickstart", "--output-dir", "{tmp}/quick"], "eval"),
         (["plot", "mixing", "--log", "{tmp}/log.jsonl", "--output", "{tmp}/fig"], "plot"),
         (["serve", "--model", "x", "--port", "0"], "serve"), (["bench", "eval"], "eval"),
         (["bench", "serve", "--model", "{tmp}/missing", "--output", "{tmp}/serve.json"], "serve")]
"""Each verb that needs an extra, and the extra."""


def test_core_install_help_of_every_verb_and_one_line_naming_a_missing_extra(tmp_path):
    """As on ``pip install -e .`` without extras: the extras' packages cannot be imported."""
    (tmp_path / "log.jsonl").write_text("")
    runs = [[verb, "--help"] for verb in VERBS] + [[a.format(tmp=tmp_path) for a in argv] for argv, _ in NEEDS]
    code = BLOCKER + CORE_RUN
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, ",".join(EXTRAS) + ",mkdocs", json.dumps(runs)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert "RESULTS" in out.stdout, out.stderr[-3000:]
    results = json.loads(out.stdout.split("RESULTS", 1)[1])
    for (verb, _), (status, err) in zip(runs[:len(VERBS)], results):
        assert status == 0, f"bitune {verb} --help: {err}"
    for (argv, extra), (status, err) in zip(NEEDS, results[len(VERBS):]):
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, (argv, err)
        assert lines[0].startswith(f"bitune {argv[0]}: error: 'bitune {argv[0]}' needs ")
        assert lines[0].endswith(f'pip install "bitune[{extra}]"'), lines[0]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "quick").exists() and not (tmp_path / "fig").exists()


@pytest.mark.parametrize("limit, processes", [(2, 3), (1, 2), (1, 16)])
def test_eval_refuses_processes_beyond_the_questions_before_launching(chain, monkeypatch, capsys, limit, processes):
    pytest.importorskip("lm_eval")
    import bitune.commands.launcher

    def launch(*args):
        raise AssertionError("launched: a process without a question ends the job in a gloo error")

    monkeypatch.setattr(bitune.commands.launcher, "launch", launch)
    before = manifest(chain)
    assert main(["eval", "--checkpoint", str(chain / "ckpt"), "--tasks", "piqa", "--limit", str(limit),
                 "--num-processes", str(processes)]) == 2
    line = one_error_line(capsys, "eval")
    assert f"--num-processes {processes}" in line and f"--limit {limit}" in line
    assert manifest(chain) == before


# ------------------------------------------------------------------------------- 3. servers that cannot serve
@pytest.mark.parametrize("option, value", [
    ("--max-queue", "0"), ("--batch-wait-ms", "1e300"), ("--batch-wait-ms", "inf"), ("--batch-wait-ms", "-1"),
    ("--max-body-bytes", "10"), ("--port", "70000"), ("--port", "-1"), ("--max-batch-size", "0"),
    ("--drain-seconds", "-1"), ("--drain-seconds", "100000")])
def test_serve_refuses_an_option_out_of_range_before_loading(tmp_path, capsys, option, value):
    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0", option, value]) == 2
    line = one_error_line(capsys, "serve")
    assert line.startswith(f"bitune serve: error: {option} ") and "must be" in line and "checkpoint" not in line


@pytest.mark.parametrize("flag, env, named", [
    (None, "s3cret\r\n", "$BITUNE_API_KEY"), (None, "s3cret\n", "$BITUNE_API_KEY"), (None, " ", "$BITUNE_API_KEY"),
    (" s3cret", None, "--api-key"), ("s3cret\t", None, "--api-key"), ("clé", None, "--api-key")])
def test_serve_refuses_a_key_no_client_could_send(tmp_path, monkeypatch, capsys, flag, env, named):
    if env is None:
        monkeypatch.delenv("BITUNE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("BITUNE_API_KEY", env)
    argv = ["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0"]
    assert main(argv + (["--api-key", flag] if flag is not None else [])) == 2
    line = one_error_line(capsys, "serve")
    assert f"error: {named} " in line and "checkpoint" not in line


def test_health_is_down_while_no_request_can_be_served():
    from bitune.serve.scheduler import QueueFull, Scheduler
    from helpers.serve import IdTokenizer, scheduler_model

    model = scheduler_model("llama")
    with pytest.raises(ValueError, match="max_queue"):
        Scheduler(model, IdTokenizer(), max_queue=0)  # every request would be "busy"
    with pytest.raises(ValueError, match="batch_wait"):
        Scheduler(model, IdTokenizer(), batch_wait=1e300)  # the model's thread would die on its first request
    scheduler = Scheduler(model, IdTokenizer())
    assert scheduler.healthy
    scheduler.stop()  # shutting down: submit refuses every request from here on
    with pytest.raises(QueueFull):
        from bitune.serve.scheduler import Job

        scheduler.submit(Job(prompt=[1, 2], max_tokens=1))
    assert not scheduler.healthy


# ------------------------------------------------------------------------------- 6. errors naming the wrong thing
@pytest.mark.parametrize("argv, prog", [
    (["chat", "--model", "x", "--compile"], "bitune chat"),
    (["generate", "--model", "x", "--prompt", "hi", "--bogus"], "bitune generate"),
    (["export", "--checkpoint", "c", "--merged", "m", "--no-merge"], "bitune export"),
    (["plot", "mixing", "--log", "l", "--output", "o", "--bogus"], "bitune plot mixing"),
    (["bench", "train", "--bogus"], "bitune bench train"),
    (["serve", "--model", "x", "stray"], "bitune serve")])
def test_an_unknown_argument_names_the_verb_and_its_help(capsys, argv, prog):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{prog}: error: unrecognized arguments: ") and err.endswith(f"see {prog} --help"), err


@pytest.mark.parametrize("argv, env, named", [
    (["--host", ""], {}, "--host"), (["--host", "  "], {}, "--host"),
    ([], {"BITUNE_API_KEY": "  "}, "$BITUNE_API_KEY")])
def test_serve_errors_name_what_the_user_gave(tmp_path, monkeypatch, capsys, argv, env, named):
    monkeypatch.delenv("BITUNE_API_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0", *argv]) == 2
    line = one_error_line(capsys, "serve")
    assert line.startswith(f"bitune serve: error: {named} ") and "--api-key" not in line, line


def test_serve_app_defines_each_function_once():
    source = Path(__file__).parents[1].joinpath("src/bitune/serve/app.py").read_text()
    names = [line.split("(")[0] for line in source.splitlines() if line.startswith(("def ", "async def "))]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)

