"""``bitune eval`` end to end on a tiny checkpoint, and the GSM8K answer extraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from bitune.cli import main  # noqa: E402
from bitune.data import datasets as data  # noqa: E402
from bitune.data.templates import Example, gsm8k_example  # noqa: E402
from bitune.eval.tasks import extract_flexible, extract_strict, gsm8k_results  # noqa: E402
from helpers.models import perturb_adapters, tiny_bitune, tiny_model  # noqa: E402
from helpers.tokenizer import tiny_tokenizer  # noqa: E402


@pytest.mark.parametrize("text, strict, flexible", [
    (" She has 3 + 4 = 7 eggs.\n#### 7", "7", "7"),
    (" 1,000 + 234 = $1,234.\n#### 1,234\n\nQuestion:", "1234", "1234"),
    (" The answer is 12.5.", None, "12.5"),
    (" It is -3, not 4. So -3", None, "-3"),
    (" #### 42 and then 17", "42", "17"),
    (" no numbers here", None, None),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert extract_strict(text) == strict
    assert extract_flexible(text) == flexible


def test_gsm8k_scores_strict_and_flexible():
    doc = {"target": gsm8k_example("q", "so 1,234\n#### 1,234").target}
    assert gsm8k_results(doc, [" so 1234\n#### 1234"]) == {"exact_match_strict": 1.0, "exact_match_flexible": 1.0}
    assert gsm8k_results(doc, [" it is 1,234."]) == {"exact_match_strict": 0.0, "exact_match_flexible": 1.0}
    assert gsm8k_results(doc, [" #### 1234 or 5"]) == {"exact_match_strict": 1.0, "exact_match_flexible": 0.0}


def fake_examples(name, split, limit=None):
    if name == "gsm8k":
        return [gsm8k_example(f"what is {i}+1?", f"{i}+1={i + 1}\n#### {i + 1}", id=str(i)) for i in range(4)]
    return [Example(prompt=f"question: {w}?\nanswer:", answer=" yes", choices=[" yes", " no", " maybe"], gold=i % 3,
                    id=str(i)) for i, w in enumerate(["cat", "dog", "sun", "sky", "sea"])]


@pytest.fixture
def checkpoint(tmp_path):
    base_dir = tmp_path / "base"
    base = tiny_model("llama")
    base.config.max_position_embeddings = 512  # room for GSM8K's 256 new tokens
    base.save_pretrained(base_dir)
    tiny_tokenizer().save_pretrained(base_dir)
    model = perturb_adapters(tiny_bitune(base_model=str(base_dir)))
    run = tmp_path / "run"
    model.save_pretrained(run / "final")
    (run / "settings.yaml").write_text("seed: 43\n")
    return run


def test_eval_cli_end_to_end(checkpoint, monkeypatch):
    monkeypatch.setattr(data, "load_examples", fake_examples)
    assert main(["eval", "--checkpoint", str(checkpoint / "final"), "--tasks", "piqa,gsm8k", "--limit", "3",
                 "--batch-size", "2", "--device", "cpu", "--max-new-tokens", "8"]) == 0
    record = json.loads((checkpoint / "eval.json").read_text())
    assert record["label"] == "bitune"
    assert set(record["tasks"]) == {"piqa", "gsm8k"}
    piqa = record["tasks"]["piqa"]
    assert piqa["n"] == 3 and 0.0 <= piqa["acc"] <= 1.0 and 0.0 <= piqa["acc_norm"] <= 1.0
    assert piqa["acc_stderr"] >= 0.0
    assert set(record["tasks"]["gsm8k"]) >= {"exact_match_strict", "exact_match_flexible"}
    assert record["config"]["train_seed"] == 43 and record["config"]["limit"] == 3
    assert record["config"]["bitune"]["variant"] == "bitune"
    assert record["timing"]["eval_s"] > 0
    assert record["timing"]["torch_threads"] == torch.get_num_threads()  # wall times are read with it
    card = (checkpoint / "final" / "README.md").read_text()  # the model card now shows these results, with n
    assert "## Evaluation" in card and card.count("## Evaluation") == 1 and "| piqa | acc |" in card
    assert f"| {100 * piqa['acc']:.1f} |" in card and "| 3 |" in card and card.startswith("---\n")


def test_eval_cli_rejects_unknown_task(checkpoint, capsys):
    assert main(["eval", "--checkpoint", str(checkpoint / "final"), "--tasks", "hellaswag"]) == 2
    assert "unknown task" in capsys.readouterr().err


@pytest.mark.parametrize("option, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),  # was: silently the task's 256
    (["--limit", str(10**30)], "--limit must be a number of questions"),
    (["--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["--label", " "], "--label is empty"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
])
def test_eval_cli_refuses_bad_numbers_before_loading(checkpoint, capsys, option, message):
    assert main(["eval", "--checkpoint", str(checkpoint / "final"), "--tasks", "piqa", *option]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_sweep_parses_methods():
    from bitune.commands.sweep import parse_methods
    from bitune.errors import BituneError

    methods = parse_methods("pretrained,lora,lora16,bitune,shared_weights")
    assert [(m.variant, m.rank) for m in methods] == [("pretrained", None), ("lora", None), ("lora", 16),
                                                      ("bitune", None), ("shared_weights", None)]
    assert methods[2].overrides() == ["bitune.variant=lora", "bitune.rank=16"]
    with pytest.raises(BituneError, match="unknown method"):
        parse_methods("lora,prefix_tuning")


def test_sweep_method_files_are_overlays_labelled_by_name():
    from pathlib import Path

    from bitune.commands.sweep import parse_methods
    from bitune.train import load_settings

    root = Path(__file__).resolve().parents[1]
    (method,) = parse_methods(str(root / "configs/methods/bitune_clip_adapters.yaml"))
    assert (method.label, method.variant, method.overrides()) == ("bitune_clip_adapters", "bitune", [])
    settings = load_settings(method.configs(str(root / "configs/study/arc_challenge.yaml")), ["seed=43"])
    assert (settings.clip, settings.bitune.variant, settings.batch_size, settings.lr) == ("adapters", "bitune", 10,
                                                                                          1e-3)


def test_sweep_takes_a_packaged_method_file_by_its_name(tmp_path, monkeypatch):
    """`--methods bitune_clip_adapters` (or `methods/bitune_clip_adapters`) is the packaged method file, as
    `--config methods/...` is; variant names keep their meaning, and a local file comes before a packaged one."""
    from bitune.commands.sweep import parse_methods
    from bitune.config_files import find_packaged
    from bitune.errors import BituneError
    from bitune.train.settings import read_yaml

    monkeypatch.chdir(tmp_path)
    packaged = find_packaged("methods/bitune_clip_adapters")
    for name in ("bitune_clip_adapters", "methods/bitune_clip_adapters", "methods/bitune_clip_adapters.yaml"):
        (method,) = parse_methods(name)
        assert (method.label, method.variant, method.overrides()) == ("bitune_clip_adapters", "bitune", [])
        assert read_yaml(method.configs(None)[0]) == read_yaml(packaged)
    assert parse_methods("bitune")[0].overlay is None  # the variant, as before
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "bitune_clip_adapters.yaml").write_text("bitune:\n  variant: only_causal\n")
    assert parse_methods("methods/bitune_clip_adapters")[0].variant == "only_causal"
    with pytest.raises(BituneError, match="unknown method 'bitune_clip_adapterz'.*packaged method file"):
        parse_methods("bitune_clip_adapterz")


def _sweep_args(checkpoint, tmp_path, monkeypatch, **changes):
    monkeypatch.setattr(data, "load_examples", fake_examples)
    rows = [{"instruction": f"say {w}", "input": "", "output": w} for w in ("yes", "no", "cat", "dog")]
    (tmp_path / "train.json").write_text(json.dumps(rows))
    config = tmp_path / "sweep.yaml"
    config.write_text(f"model: {tmp_path / 'base'}\ndataset: {tmp_path / 'train.json'}\nsteps: 1\n"
                      "grad_accum: 1\nlog_every: 1\nbf16: 'false'\n")
    options = {"--config": str(config), "--methods": "bitune", "--seeds": "1", "--tasks": "piqa", "--limit": "2",
               "--batch-size": "4", "--output-dir": str(tmp_path / "sweep"), "--device": "cpu", **changes}
    return ["sweep", *[x for kv in options.items() for x in kv]]


@pytest.mark.slow
def test_sweep_trains_evaluates_and_reports(checkpoint, tmp_path, monkeypatch):
    args = _sweep_args(checkpoint, tmp_path, monkeypatch, **{"--methods": "pretrained,bitune", "--seeds": "1,2"})
    out = tmp_path / "sweep"
    assert main(args) == 0
    for run in ("pretrained", "bitune-1", "bitune-2"):
        assert (out / run / "eval.json").is_file()
    assert json.loads((out / "bitune-2" / "eval.json").read_text())["config"]["train_seed"] == 2
    md = (out / "report.md").read_text()  # bitune report's: the table over seeds, then intervals and pairs
    table = md[md.index("| method |"):].split("\n\n")[0].splitlines()[2:]
    assert [line.split("|")[1].strip() for line in table] == ["pretrained", "bitune"]
    assert "## Paired differences" in md and "| bitune | pretrained | 2 |" in md  # bitune vs pretrained, 2 seeds
    assert (out / "report.csv").is_file()
    assert main(args) == 0  # everything done: nothing is retrained or re-evaluated


def test_sweep_restarts_an_interrupted_run_without_deleting_other_files_or_a_running_one(checkpoint, tmp_path,
                                                                                         monkeypatch, capsys):
    from bitune.train.run_folder import run_lock

    args = _sweep_args(checkpoint, tmp_path, monkeypatch)
    run = tmp_path / "sweep" / "bitune-1"
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    (run / "log.jsonl").write_text('{"step": 1}\n')  # an interrupted run: a log, no checkpoint
    with run_lock(run):  # another process is training there
        assert main(args) == 2
    assert "in use" in capsys.readouterr().err and (run / "log.jsonl").is_file() and (run / "notes.txt").is_file()
    assert main(args) == 0  # restarted: the run's own files replaced, the user's kept
    assert (run / "notes.txt").read_text() == "mine" and (run / "eval.json").is_file()


@pytest.mark.parametrize("changes, message", [
    ({"--limit": "3"}, "with --limit 2; this sweep asks for piqa (validation) with --limit 3"),
    ({"--tasks": "arc_easy"}, "evaluation of piqa (validation) with --limit 2; this sweep asks for arc_easy (test)"),
    ({"--split": "tuning"}, "evaluation of piqa (validation) with --limit 2; this sweep asks for piqa (dev)"),
])
def test_sweep_refuses_an_earlier_evaluation_of_other_tasks_or_questions(checkpoint, tmp_path, monkeypatch, capsys,
                                                                          changes, message):
    assert main(_sweep_args(checkpoint, tmp_path, monkeypatch)) == 0
    assert main(_sweep_args(checkpoint, tmp_path, monkeypatch, **changes)) == 2
    assert message in capsys.readouterr().err


def test_a_second_sweep_into_a_folder_extends_its_report(checkpoint, tmp_path, monkeypatch):
    """The report is the folder's: another method swept into it later joins the earlier runs, instead of a report
    of the second sweep's runs alone replacing the first one's."""
    assert main(_sweep_args(checkpoint, tmp_path, monkeypatch)) == 0
    assert main(_sweep_args(checkpoint, tmp_path, monkeypatch, **{"--methods": "pretrained"})) == 0
    md = (tmp_path / "sweep" / "report.md").read_text()
    table = md[md.index("| method |"):].split("\n\n")[0].splitlines()[2:]
    assert [line.split("|")[1].strip() for line in table] == ["pretrained", "bitune"]


@pytest.mark.parametrize("changes, message", [
    ({"--limit": "3"}, "evaluated with --limit 2, this sweep 3"),
    ({"--split": "tuning"}, "evaluated with piqa on its validation split, this sweep on dev"),
])
def test_a_sweep_into_a_folder_of_runs_on_other_questions_is_refused_before_training(checkpoint, tmp_path,
                                                                                     monkeypatch, capsys, changes,
                                                                                     message):
    assert main(_sweep_args(checkpoint, tmp_path, monkeypatch, **{"--methods": "pretrained"})) == 0
    report = (tmp_path / "sweep" / "report.md").read_text()
    assert main(_sweep_args(checkpoint, tmp_path, monkeypatch, **changes)) == 2
    err = capsys.readouterr().err
    assert message in err and "Use another --output-dir" in err
    assert not (tmp_path / "sweep" / "bitune-1").exists()  # nothing trained
    assert (tmp_path / "sweep" / "report.md").read_text() == report  # the folder's report untouched


@pytest.mark.parametrize("changes, message", [
    ({"--seeds": "42,42"}, "--seeds names 42 twice"),
    ({"--methods": "lora,bitune,lora"}, "--methods names 'lora' twice"),
    ({"--limit": "0"}, "--limit must be"),
    ({"--batch-size": "0"}, "--batch-size must be >= 1"),
])
def test_sweep_refuses_bad_options_before_training(checkpoint, tmp_path, monkeypatch, capsys, changes, message):
    assert main(_sweep_args(checkpoint, tmp_path, monkeypatch, **changes)) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "sweep").exists()


def test_lm_eval_own_cli_runs_the_bitune_model_type(checkpoint, tmp_path, monkeypatch):
    """lm-eval's CLI (through bitune.eval.harness, which registers the model type and the task folder)."""
    from bitune.eval import harness

    monkeypatch.setattr(data, "load_examples", fake_examples)
    out = tmp_path / "lm_eval_out"
    harness.main(["--model", "bitune", "--model_args", f"checkpoint={checkpoint / 'final'}", "--device", "cpu",
                  "--tasks", "bitune_piqa", "--limit", "2", "--batch_size", "2", "--output_path", str(out)])
    files = list(out.rglob("results_*.json"))
    assert len(files) == 1
    results = json.loads(files[0].read_text())["results"]["bitune_piqa"]
    assert 0.0 <= results["acc,none"] <= 1.0


def _evaluate_as_rank(rank: int, world: int, port: int, checkpoint: str, output: str) -> None:
    """One process of a ``world``-process evaluation (what ``bitune eval --num-processes`` launches)."""
    import os

    from bitune.eval.evaluate import evaluate_run

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    data.load_examples = fake_examples
    evaluate_run(checkpoint=checkpoint, tasks="piqa", batch_size=2, device="cpu", output=Path(output))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_two_processes_score_every_question_once_as_one_process_does(checkpoint, tmp_path, monkeypatch):
    """lm-eval's data-parallel protocol: 2 gloo processes each score every 2nd question, rank 0 gathers; the
    per-question scores and the metrics equal one process's (1e-5), and every question appears once."""
    import socket

    import torch.multiprocessing as mp

    from bitune.eval.evaluate import evaluate_run

    monkeypatch.setattr(data, "load_examples", fake_examples)
    one = evaluate_run(checkpoint=str(checkpoint / "final"), tasks="piqa", batch_size=2, device="cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "two.json"
    mp.spawn(_evaluate_as_rank, args=(2, port, str(checkpoint / "final"), str(out)), nprocs=2, join=True)
    two = json.loads(out.read_text())
    assert two["config"]["processes"] == 2 and one["config"]["processes"] == 1
    a, b = one["samples"]["piqa"], two["samples"]["piqa"]
    assert b["doc_id"] == a["doc_id"] == [0, 1, 2, 3, 4]  # each question once, in doc order
    assert b["gold"] == a["gold"] and b["acc"] == a["acc"]
    for x, y in zip(a["loglik"], b["loglik"]):
        assert y == pytest.approx(x, abs=1e-5)
    assert two["tasks"]["piqa"]["acc"] == pytest.approx(one["tasks"]["piqa"]["acc"], abs=1e-5)


def test_eval_argv_passes_every_option_to_the_launched_processes():
    from bitune.commands import eval as eval_command
    from bitune.commands.options import ArgumentParser

    parser = ArgumentParser()
    eval_command.configure(parser)
    given = ["--checkpoint", "c/final", "--tasks", "piqa", "--limit", "7", "--batch-size", "3", "--device", "cpu",
             "--dtype", "bfloat16", "--prompt-passes", "sequential", "--seed", "5", "--label", "x", "--output",
             "o.json", "--template", "paper", "--threads", "1", "--no-merge", "--num-processes", "2"]
    args = parser.parse_args(given)
    again = parser.parse_args(eval_command.eval_argv(args)[1:])
    assert {**vars(again), "num_processes": 2} == vars(args)
