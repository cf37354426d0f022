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
from helpers.scripts import load_script
from test_cli_errors import no_work, one_error_line  # noqa: F401 (no_work: a fixture)


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
    """Also a file that merely looks like the tokenizer's (issue 57: `tokenizer_notes.txt` matched `tokenizer*`)
    and a folder beside the export named like its scratch folder (`.exported.old/` was removed)."""
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(chain / "ckpt"), "--merged", str(out)]) == 0
    (out / "README.md").write_text("my notes on this export\n")
    (out / "eval").mkdir()
    (out / "eval" / "scores.txt").write_text("0.51\n")
    (out / "tokenizer_notes.txt").write_text("which tokenizer I used\n")
    (tmp_path / ".exported.old").mkdir()
    (tmp_path / ".exported.old" / "keep.txt").write_text("mine\n")
    mine = manifest(out / "eval", tmp_path / ".exported.old") | {
        str(out / n): manifest(out)[str(out / n)] for n in ("README.md", "tokenizer_notes.txt")}
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(chain / "ckpt"), "--merged", str(out)]) == 0
    assert "kept README.md, eval, tokenizer_notes.txt" in capsys.readouterr().out
    after = manifest(tmp_path)
    assert {k: after.get(k) for k in mine} == mine and (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".exported.old", "exported"]  # no scratch folder left


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



# =============================================================================== issue 57: new unseen inputs
def _eval_json(folder: Path, label: str = "lora", seed: int = 42, model: str = "m") -> Path:
    """A ``bitune eval`` result on piqa (validation) with ``--limit 2`` of base ``model``, in ``folder/eval.json``."""
    from bitune.eval import SCHEMA

    folder.mkdir(parents=True, exist_ok=True)
    record = {"schema": SCHEMA, "label": label, "tasks": {"piqa": {"acc": 0.5, "acc_norm": 0.5}},
              "config": {"train_seed": seed, "limit": 2, "model": model},
              "samples": {"piqa": {"doc_id": [0, 1], "acc": [1.0, 0.0], "acc_norm": [1.0, 0.0]}}}
    (folder / "eval.json").write_text(json.dumps(record))
    return folder / "eval.json"


def _sweep(chain, tmp_path, methods="pretrained", out="sw") -> list[str]:
    config = tmp_path / "train.yaml"
    config.write_text(f"model: {chain / 'base'}\nsteps: 1\n")
    return ["sweep", "--config", str(config), "--methods", methods, "--seeds", "1", "--tasks", "piqa", "--limit", "2",
            "--device", "cpu", "--output-dir", str(tmp_path / out)]


USERS_FILE = {  # a verb writing into a folder, the user's file there it must leave alone, what the error says
    "sweep": ("sw/report.md", "is not a report written by bitune report"),
    "report": ("o/report.md", "is not a report written by bitune report"),
    "report-csv": ("o/report.csv", "is not a table written by bitune report"),
    "report-in-place": ("runs/report.md", "is not a report written by bitune report"),
    "plot": ("fig/mixing_final.png", "is not a figure written by bitune plot"),
}


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("case", USERS_FILE)
def test_a_verb_writing_into_a_folder_refuses_a_users_file_of_its_outputs_name(chain, tmp_path, capsys, case):
    """Issue 57 class 1: `echo notes > sw/report.md; bitune sweep ... --output-dir sw` ended by replacing it; so
    did report into its folder and plot into its --output (eval/generate/chat/bench: tests above)."""
    pytest.importorskip("lm_eval")
    name, says = USERS_FILE[case]
    _eval_json(tmp_path / "runs" / "lora-42")
    (tmp_path / "log.jsonl").write_text('{"step": 1, "mixing/a_k": [0.5, 0.5], "mixing/a_v": [0.5, 0.5]}\n')
    mine = tmp_path / name
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_bytes(b"\x89PNG my own picture" if name.endswith(".png") else b"# My notes\nmine\n")
    argv = {"sweep": _sweep(chain, tmp_path),
            "report": ["report", str(tmp_path / "runs"), "--output", str(tmp_path / "o")],
            "report-csv": ["report", str(tmp_path / "runs"), "--output", str(tmp_path / "o")],
            "report-in-place": ["report", str(tmp_path / "runs")],
            "plot": ["plot", "mixing", "--log", str(tmp_path / "log.jsonl"), "--output", str(tmp_path / "fig")]}[case]
    before = manifest(tmp_path)
    assert main(argv) == 2
    line = one_error_line(capsys, argv[0])
    assert str(mine) in line and says in line and "move it away first" in line, line
    assert manifest(tmp_path) == before


def test_report_embeds_into_no_file_it_writes_itself_and_checks_before_writing(tmp_path, capsys):
    """`bitune report RUNS --output o --embed-summary o/report.md` overwrote the user's document, wrote report.csv,
    then failed the embed."""
    from bitune.eval.report import SUMMARY_BEGIN, SUMMARY_END

    _eval_json(tmp_path / "runs" / "lora-42")
    out = tmp_path / "o"
    out.mkdir()
    (out / "report.md").write_text(f"my document\n{SUMMARY_BEGIN}\n{SUMMARY_END}\n")
    before = manifest(tmp_path)
    argv = ["report", str(tmp_path / "runs"), "--output", str(out), "--embed-summary", str(out / "report.md")]
    assert main(argv) == 2
    assert "is not a report written by bitune report" in one_error_line(capsys, "report")
    assert manifest(tmp_path) == before
    (out / "report.md").unlink()
    assert main(argv[:4]) == 0  # the report's own report.md now: still no document to embed into
    before = manifest(tmp_path)
    assert main(argv) == 2
    assert "is a file the report itself writes" in one_error_line(capsys, "report")
    assert manifest(tmp_path) == before
    assert main(argv[:4]) == 0  # an earlier report of its own is replaced


def test_report_replaces_the_report_an_older_sweep_wrote(tmp_path):
    """A sweep of bitune before the report verb (a study's pinned tree still runs one) wrote report.md as the bare
    table; the folder's report is then refreshed over it, as study part 4 does, and a user's table is not."""
    _eval_json(tmp_path / "runs" / "lora-42")
    older = "| method | seeds | PIQA | Avg |\n|---|---|---:|---:|\n| lora | 1 | 50.00 ± - | 50.00 ± - |\n"
    (tmp_path / "runs" / "report.md").write_text(older)
    assert main(["report", str(tmp_path / "runs")]) == 0
    assert (tmp_path / "runs" / "report.md").read_text().startswith("# Report: ")
    (tmp_path / "runs" / "report.md").write_text("| my | own | table |\n")
    assert main(["report", str(tmp_path / "runs")]) == 2


# ------------------------------------------------------------------------------- 2. servers that cannot serve
@pytest.mark.parametrize("compile", [False, True])
def test_serve_refuses_a_max_model_len_no_request_fits_before_loading(tmp_path, capsys, compile):
    argv = ["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0", *(["--compile"] if compile else [])]
    assert main([*argv, "--max-model-len", "2"]) == 2
    assert "error: --max-model-len 2: must be >= 3" in one_error_line(capsys, "serve")
    assert main([*argv, "--max-model-len", "3"]) == 2  # the shortest that can answer: on to the checkpoint
    assert "--max-model-len" not in one_error_line(capsys, "serve")


def test_serve_compile_checks_the_slot_caches_memory_before_allocating(chain, monkeypatch, capsys):
    """`serve --compile --max-batch-size 65536 --max-model-len 2048` failed in `DefaultCPUAllocator: can't allocate
    memory`, naming neither option."""
    pytest.importorskip("uvicorn")
    import psutil

    import bitune.serve.slots

    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": 10_000})())
    monkeypatch.setattr(bitune.serve.slots, "SlotBatch", lambda *a, **k: pytest.fail("allocated"))
    assert main(["serve", "--checkpoint", str(chain / "ckpt"), "--port", "0", "--compile", "--max-batch-size", "4",
                 "--max-model-len", "64"]) == 2
    line = one_error_line(capsys, "serve")
    assert "--max-batch-size 4 x --max-model-len 64" in line and "bytes" in line and "10000 bytes" in line, line


def test_the_slot_caches_computed_bytes_are_what_it_allocates():
    from bitune.serve.slots import SlotBatch, cache_bytes

    model = tiny_bitune().eval()
    batch = SlotBatch(model, 3, 16, compile=False)
    assert cache_bytes(model.text_config, 3, 16, next(model.parameters()).dtype) == batch.cache.nbytes > 0


# ------------------------------------------------------------------------------- 3. crashes
def test_bench_eval_refuses_a_generation_task_in_one_line_before_loading(capsys):
    """`bitune bench eval --task gsm8k` was `unexpected TypeError: can only concatenate str (not "dict")`."""
    pytest.importorskip("lm_eval")
    assert main(["bench", "eval", "--model", "no-such-model", "--task", "gsm8k"]) == 2
    line = one_error_line(capsys, "bench")
    assert "--task gsm8k is a generate_until task" in line and "no-such-model" not in line, line


def _bench_serve_args(chain, **changes):
    import argparse

    return argparse.Namespace(**{"model": str(chain / "base"), "bitune": None, "lora": None, "clients": 1,
                                 "requests": 1, "prompt_tokens": 8, "new_tokens": 2, "rounds": 2, "max_batch_size": 2,
                                 "threads": 1, "dtype": "float32", "device": None, "no_transformers": True,
                                 "compile": False, "only": None, "output": None, **changes})


def test_bench_serve_ratios_of_an_untimeable_load_are_none_and_each_finished_load_is_saved(chain, monkeypatch):
    """`bench serve --new-tokens 2 --requests 1` ended, after every server ran, in a ZeroDivisionError in a ratio
    (a load too short for the CPU clock: 0 ms per token), and all results were lost."""
    pytest.importorskip("uvicorn")
    from bitune.bench import serve

    saved = []

    def run_servers(groups, fresh, args, save):
        out = {}
        for r in range(args.rounds):
            for s in groups[0]:
                out.setdefault(s.name, []).append({"tokens_per_s": 10.0, "ttft_p50_s": 0.1, "latency_p50_s": 0.2,
                                                   "cpu_ms_per_token": 0.0, "stream_decode_tok_s": 5.0})
                save({name: list(v) for name, v in out.items()})
        return out

    monkeypatch.setattr(serve, "run_servers", run_servers)
    monkeypatch.setattr(serve, "checkpoints", lambda args, work: {"bitune": "b", "lora": "l"})
    args = _bench_serve_args(chain, save_part=saved.append)
    record = serve.measure(args)
    assert record["ratios"]["bitune_vs_pretrained_cpu"] is None and record["ratios"]["bitune_vs_pretrained"] == 1.0
    assert len(saved) == 2 * 6 and all(part["partial"] and part["model"] == args.model for part in saved)
    assert saved[-1]["per_round"] == record["per_round"]


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("script, case", [("study_pick.py", "empty"), ("study_pick.py", "missing"),
                                          ("study_figures.py", "unwritable")])
def test_a_script_fails_in_one_line_like_the_cli(tmp_path, script, case):
    folder = tmp_path / "runs"
    if case != "missing":
        folder.mkdir()
    if case == "unwritable":  # a read-only figure: a folder of that name, which no user (root too) may write
        (folder / "lora-42").mkdir()
        (folder / "lora-42" / "log.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"train_runtime": 1.0}\n')
        (folder / "training.png").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    labels = ["lora"] if script == "study_pick.py" else []
    job = subprocess.run([sys.executable, str(SCRIPTS / script), str(folder), *labels], capture_output=True,
                         text=True, timeout=120, env=env)
    name = script.removesuffix(".py").replace("_", " ")
    lines = job.stderr.strip().splitlines()
    assert job.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"{name}: error: "), job.stderr
    assert str(folder) in lines[0]


def test_study_figures_leaves_out_a_run_whose_log_is_cut_in_its_last_line(tmp_path):
    figures = load_script("study_figures")
    for run, tail in (("lora-42", '{"train_runtime": 1.0}\n'), ("bitune-42", '{"step": 2, "lo')):
        (tmp_path / run).mkdir()
        (tmp_path / run / "log.jsonl").write_text('{"step": 1, "loss": 1.0}\n' + tail)
    assert list(figures.runs(tmp_path)) == [("lora", 42)]
    (tmp_path / "lora-42" / "log.jsonl").write_text('{"step": 1, "lo\n{"train_runtime": 1.0}\n')
    with pytest.raises(ValueError, match="log.jsonl:1: not valid JSON"):
        figures.runs(tmp_path)


# ------------------------------------------------------------------------------- 4. work before a check
@pytest.mark.usefixtures("no_work")
def test_sweep_checks_every_input_before_the_first_run(chain, tmp_path, capsys):
    """Into a folder holding another base model's run; a bad setting in a later --methods file (the error names
    it); a later run's corrupt eval.json: each found after earlier runs trained."""
    pytest.importorskip("lm_eval")
    _eval_json(tmp_path / "sw" / "lora-42", model="another-model")
    argv = _sweep(chain, tmp_path)
    before = manifest(tmp_path)
    assert main(argv) == 2
    assert "a run of the base model 'another-model'" in one_error_line(capsys, "sweep")
    assert manifest(tmp_path) == before

    bad = tmp_path / "bad_rank.yaml"
    bad.write_text("bitune:\n  rank: -1\n")
    assert main(_sweep(chain, tmp_path, f"lora,{bad}", out="sw2")) == 2
    line = one_error_line(capsys, "sweep")
    assert f"method file {bad}: " in line and "rank" in line, line
    assert not (tmp_path / "sw2").exists()

    (tmp_path / "sw3" / "bitune-1").mkdir(parents=True)
    (tmp_path / "sw3" / "bitune-1" / "eval.json").write_text("{cut")
    argv = _sweep(chain, tmp_path, "lora,bitune", out="sw3")
    before = manifest(tmp_path)
    assert main(argv) == 2
    assert "eval.json: not valid JSON" in one_error_line(capsys, "sweep")
    assert manifest(tmp_path) == before


def test_eval_of_a_read_only_checkpoint_with_its_output_elsewhere_succeeds(tmp_path, monkeypatch, capsys):
    """It wrote the result, then exited 2 over the checkpoint's README.md, a file the user never named."""
    pytest.importorskip("lm_eval")
    from bitune.data import datasets
    from bitune.data.templates import Example

    monkeypatch.setattr(datasets, "load_examples", lambda name, split, limit=None: [
        Example(prompt=f"question: {w}?\nanswer:", answer=" yes", choices=[" yes", " no"], gold=0, id=str(i))
        for i, w in enumerate(["cat", "dog"])])
    ckpt, _ = save_checkpoint(tmp_path)
    replace = os.replace

    def read_only(src, dst, *args, **kwargs):  # the checkpoint's folder is read-only (also to root)
        if ckpt.resolve() in Path(dst).resolve().parents:
            raise PermissionError(13, "Permission denied", str(dst))
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", read_only)
    before = manifest(ckpt)
    assert main(["eval", "--checkpoint", str(ckpt), "--tasks", "piqa", "--limit", "2", "--device", "cpu",
                 "--output", str(tmp_path / "e.json")]) == 0
    assert (tmp_path / "e.json").is_file() and manifest(ckpt) == before


# ------------------------------------------------------------------------------- 5. silently accepted or dropped
@pytest.mark.parametrize("case", ["other-base", "lora-merge-bidir"])
def test_bench_eval_refuses_a_checkpoint_its_row_cannot_claim_before_loading(chain, tmp_path, capsys, monkeypatch,
                                                                            case):
    """`bench eval --model tiny2 --checkpoint CK` (trained on another base) reported Bitune at 1.65x hf; a LoRA
    checkpoint with --merge-bidir was recorded as `bitune_merge: both`."""
    pytest.importorskip("lm_eval")
    import bitune.bench.eval

    monkeypatch.setattr(bitune.bench.eval, "load_bitune", lambda *a, **k: pytest.fail("loaded"))
    if case == "other-base":
        argv, says = ["--model", str(chain / "exported"), "--checkpoint", str(chain / "ckpt")], "was trained on"
    else:
        tiny_bitune(variant="lora", base_model=str(chain / "base")).save_pretrained(tmp_path / "lora")
        argv, says = ["--model", str(chain / "base"), "--checkpoint", str(tmp_path / "lora"), "--merge-bidir"], \
            "is a 'lora' checkpoint"
    assert main(["bench", "eval", *argv, "--limit", "2"]) == 2
    line = one_error_line(capsys, "bench")
    assert line.startswith("bitune bench: error: --checkpoint ") and says in line, line


@pytest.mark.parametrize("only", ["", " , "])
def test_bench_serve_only_naming_no_server_is_refused_before_anything_loads(chain, monkeypatch, only):
    pytest.importorskip("uvicorn")
    from bitune.bench import serve
    from bitune.errors import BituneError

    monkeypatch.setattr(serve, "checkpoints", lambda *a: pytest.fail("made checkpoints"))
    with pytest.raises(BituneError, match="--only .*names no server; the servers are bitune, "):
        serve.measure(_bench_serve_args(chain, only=only))


def test_report_refuses_a_report_yaml_whose_runs_names_a_missing_folder(tmp_path, capsys):
    """The method in the missing folder was dropped from the report without a word."""
    _eval_json(tmp_path / "study" / "arc_easy" / "lora-42")
    (tmp_path / "study" / "report.yaml").write_text("runs: [arc_easy, csqa]\n")
    before = manifest(tmp_path)
    assert main(["report", str(tmp_path / "study")]) == 2
    line = one_error_line(capsys, "report")
    assert "runs names 'csqa'" in line and "report.yaml" in line, line
    assert manifest(tmp_path) == before


# ------------------------------------------------------------------------------- 6. errors naming what was given
def test_a_setting_under_its_older_name_is_named_as_written(tmp_path, capsys):
    """`gradient_checkpointing: maybe` gave an error about `recompute`, a key the file never names."""
    config = tmp_path / "run.yaml"
    config.write_text("gradient_checkpointing: maybe\n")
    with pytest.warns(DeprecationWarning, match="gradient_checkpointing is now called recompute"):
        assert main(["train", "--config", str(config), "--dry-run"]) == 2
    line = one_error_line(capsys, "train")
    assert "gradient_checkpointing='maybe'" in line and not line.split("error: ")[1].startswith("recompute"), line


def test_bench_serve_compiles_its_servers_within_the_models_positions(chain, monkeypatch):
    """`bench serve --compile` asked its servers for `--max-model-len 68` (a value it added itself, past the
    model's positions) and failed only after servers started, naming that option."""
    pytest.importorskip("uvicorn")
    from bitune.bench import serve

    started = []
    monkeypatch.setattr(serve, "run_servers", lambda groups, *a: started.extend(groups[0]) or {})
    monkeypatch.setattr(serve, "checkpoints", lambda args, work: {"bitune": "b", "lora": "l"})
    serve.measure(_bench_serve_args(chain, compile=True, prompt_tokens=100, new_tokens=28))  # servers listed only
    lengths = [int(s.command[s.command.index("--max-model-len") + 1]) for s in started if "--compile" in s.command]
    assert lengths == [128, 128, 128]  # the model's 128 positions: prompt 100 + answer 28 fit
