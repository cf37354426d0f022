"""``bitune report``: mean and sample std over seeds, the average column, Markdown/CSV output."""

from __future__ import annotations

import csv
import io
import json
import math
import re

import numpy as np
import pytest

from bitune.cli import main
from bitune.eval import SCHEMA
from bitune.eval.report import aggregate
from bitune.stats import seed_aware_test


def record(label, seed, piqa, arc, gsm=None):
    tasks = {"piqa": {"acc": piqa, "acc_norm": piqa / 2}, "arc_challenge": {"acc": arc, "acc_norm": arc}}
    if gsm is not None:
        tasks["gsm8k"] = {"exact_match_strict": gsm, "exact_match_flexible": 1.0}
    return {"schema": SCHEMA, "label": label, "tasks": tasks, "config": {"train_seed": seed, "limit": None}}


def test_mean_and_sample_std_over_seeds():
    recs = [record("lora", 42, 0.70, 0.30), record("lora", 43, 0.72, 0.34), record("lora", 44, 0.74, 0.32),
            record("bitune", 42, 0.80, 0.40)]
    rep = aggregate(recs)
    piqa = rep.cells["lora"]["piqa"]
    assert piqa.mean == pytest.approx(0.72)
    assert piqa.std == pytest.approx(0.02)  # ddof=1: sqrt((0.02^2 + 0 + 0.02^2) / 2)
    avg = rep.cells["lora"]["avg"]
    assert avg.values == pytest.approx([0.50, 0.53, 0.53])
    assert avg.std == pytest.approx(math.sqrt(((0.5 - 0.52) ** 2 + 2 * 0.01 ** 2) / 2))
    assert math.isnan(rep.cells["bitune"]["piqa"].std)
    rows = {r[0]: r for r in rep.rows()}
    assert rows["lora"][:3] == ["lora", "3", "72.00 ± 2.00"]
    assert rows["bitune"][2] == "80.00 ± -"


def test_metric_choice_and_gsm8k_metric():
    recs = [record("a", 1, 0.6, 0.2, gsm=0.1), record("a", 2, 0.8, 0.2, gsm=0.3)]
    rep = aggregate(recs, metric="acc_norm", gsm8k_metric="exact_match_strict")
    assert rep.tasks == ["piqa", "arc_challenge", "gsm8k"]
    assert rep.cells["a"]["piqa"].mean == pytest.approx(0.35)
    assert rep.cells["a"]["gsm8k"].mean == pytest.approx(0.2)


def test_report_cli_writes_markdown_and_csv(tmp_path):
    for i, (p, a) in enumerate([(0.70, 0.30), (0.74, 0.32)]):
        d = tmp_path / "runs" / f"lora-{i}"
        d.mkdir(parents=True)
        (d / "eval.json").write_text(json.dumps(record("lora", 42 + i, p, a)))
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "runs"), "--output", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "| method | seeds | PIQA | ARC-C | Avg |" in md and "72.00 ± 2.83" in md
    rows = list(csv.DictReader(io.StringIO((out / "report.csv").read_text())))
    assert rows[0]["method"] == "lora" and float(rows[0]["piqa_mean"]) == pytest.approx(72.0)
    assert float(rows[0]["avg_std"]) == pytest.approx(100 * math.sqrt(2 * 0.015 ** 2), abs=1e-4)


def test_a_study_reads_the_runs_it_links_from_an_earlier_study_once_each(tmp_path):
    """A study compared with an earlier one links the earlier runs into its folder (they keep their commit and
    batch digests): the report reads them through the links; a link back up, or a second link to a run, adds
    nothing twice."""
    earlier = tmp_path / "part4" / "lora-42"
    earlier.mkdir(parents=True)
    (earlier / "eval.json").write_text(json.dumps(record("lora", 42, 0.70, 0.30)))
    study = tmp_path / "part5" / "runs"
    (study / "recipe-42").mkdir(parents=True)
    (study / "recipe-42" / "eval.json").write_text(json.dumps(record("recipe", 42, 0.74, 0.36)))
    (study / "lora-42").symlink_to(earlier, target_is_directory=True)
    (study / "again").symlink_to(earlier, target_is_directory=True)
    (study / "up").symlink_to(study, target_is_directory=True)
    out = tmp_path / "out"
    assert main(["report", str(study), "--output", str(out), "--no-figure"]) == 0
    rows = {r["method"]: r for r in csv.DictReader(io.StringIO((out / "report.csv").read_text()))}
    assert set(rows) == {"lora", "recipe"} and float(rows["lora"]["piqa_mean"]) == pytest.approx(70.0)
    assert "2 runs" in (out / "report.md").read_text()


def test_report_cli_fails_cleanly_without_results(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no eval results" in capsys.readouterr().err


# ------------------------------------------------------------------------------ paired statistics (per question)
def paired_record(label, seed, correct, limit=None, task="arc_challenge"):
    """An eval JSON with per-question results: ``correct`` is the 0/1 acc of each question."""
    n = len(correct)
    return {"schema": SCHEMA, "label": label, "config": {"train_seed": seed, "limit": limit},
            "tasks": {task: {"acc": sum(correct) / n, "acc_norm": sum(correct) / n, "n": n}},
            "samples": {task: {"doc_id": list(range(n)), "gold": [0] * n, "acc": [float(c) for c in correct],
                               "acc_norm": [float(c) for c in correct]}}}


def write_runs(root, records):
    for r in records:
        d = root / f"{r['label']}-{r['config']['train_seed']}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "eval.json").write_text(json.dumps(r))


def test_paired_differences_and_mcnemar_per_seed():
    from bitune.eval.report import collect_runs, difference_rows

    n = 100
    lora = [[1] * 20 + [0] * 80, [1] * 30 + [0] * 70]  # seeds 42, 43: 20% and 30%
    bitune = [[1] * 30 + [0] * 70, [0] * 10 + [1] * 30 + [0] * 60]  # seed 42: +10 over lora; seed 43: +0
    records = [paired_record("lora", 42, lora[0]), paired_record("lora", 43, lora[1]),
               paired_record("bitune", 42, bitune[0]), paired_record("bitune", 43, bitune[1]),
               paired_record("pretrained", None, [1] * 25 + [0] * 75)]
    tasks, skipped = collect_runs(records)
    assert not skipped and list(tasks["arc_challenge"].methods) == ["pretrained", "bitune", "lora"]  # then by name
    rows = {(r[2], r[3]): r for r in difference_rows(tasks, ["lora", "pretrained"])}
    row = rows[("bitune", "lora")]
    assert row[1] == str(n) and row[4] == "2"
    assert row[5].startswith("+5.0 [")  # (30 + 30) / 2 - (20 + 30) / 2 = +5 points, pooled over seeds
    test = seed_aware_test(np.stack([np.array(b, float) - np.array(a, float) for a, b in zip(lora, bitune)]))
    two_level, seed_aware = row[6], row[7]  # both wider than the question-level interval (seeds differ by 10)
    width = [float(x) for x in row[5][row[5].index("[") + 1:-1].split(", ")]
    width2 = [float(x) for x in two_level[1:-1].split(", ")]
    width3 = [float(x) for x in seed_aware[1:-1].split(", ")]
    assert seed_aware == f"[{100 * test.interval.low:+.1f}, {100 * test.interval.high:+.1f}]"
    assert width3[1] - width3[0] > width2[1] - width2[0] > width[1] - width[0]
    assert width3[0] < 0 < width3[1] and float(row[11].split()[0]) > 0.05  # two seeds, +10 and 0: not resolved
    # per question, seed-averaged: +0.5 on 20..29 (seed 42) and 30..39 (seed 43), -0.5 on 0..9 (seed 43): the
    # sign-flip p-value is that of 20 positive against 10 negative (an exact sign test: 2 P[Bin(30, 1/2) <= 10])
    exact = 2 * sum(math.comb(30, k) for k in range(11)) / 2 ** 30
    assert float(row[8]) == pytest.approx(exact, abs=0.01)
    assert row[9] == "42: +10.0; 43: +0.0"
    # seed 42: bitune right only on 20..29 (10), lora never alone; seed 43: 10 each way (0..9 vs 30..39)
    assert row[10] == f"10/0, p={2 / 2 ** 10:.3g}; 10/10, p=1"
    assert row[11] == f"{test.p:.3g}"
    assert rows[("lora", "pretrained")][9] == "42: -5.0; 43: +5.0"  # every seed against the one untrained run
    assert ("pretrained", "lora") not in rows and ("lora", "lora") not in rows  # shown once, as lora vs pretrained


def test_report_resolves_by_the_seed_aware_test_not_the_question_level_one():
    """Seeds that disagree (+10, -6, +11 points) while every question agrees within a seed: the question-level
    sign-flip p is tiny, but the difference does not hold across training seeds, so after Holm it is not
    resolved; a method better by 12% of the baseline's wrong answers in every seed is."""
    from bitune.eval.report import analyse

    n = 1000
    rng = np.random.default_rng(0)
    lora = [rng.random(n) < 0.5 for _ in range(3)]
    moved = [(0, 100, 1), (100, 160, -1), (160, 270, 1)]  # seed pair s: questions [lo, hi) move by sign
    records = []
    for s, (lo, hi, sign) in zip((42, 43, 44), moved):
        base = lora[s - 42].copy()
        base[lo:hi] = sign < 0  # the baseline right there only where the method loses
        method = base.copy()
        method[lo:hi] = sign > 0
        better = base | (rng.random(n) < 0.12)
        records += [paired_record("lora", s, base.astype(int).tolist()),
                    paired_record("bitune", s, method.astype(int).tolist()),
                    paired_record("bitune_warm", s, better.astype(int).tolist())]
    a = analyse(records, baselines=("lora",))
    holm_p = {(c.method, c.baseline): p for c, p in zip(a.found, a.adjusted)}
    seesaw = next(c for c in a.found if (c.method, c.baseline) == ("bitune", "lora"))
    assert seesaw.question_p < 0.001 and seesaw.test.interval.low < 0 < seesaw.test.interval.high
    assert holm_p[("bitune", "lora")] > 0.05
    assert holm_p[("bitune_warm", "lora")] < 0.05  # resolved (a t with 2 degrees of freedom: not far below)


def test_an_ablation_is_also_compared_with_bitune():
    from bitune.eval.report import build_markdown

    records = [paired_record("lora", 42, [1] * 20 + [0] * 80), paired_record("bitune", 42, [1] * 30 + [0] * 70),
               paired_record("shared_weights", 42, [1] * 26 + [0] * 74)]
    _, markdown, _ = build_markdown(records)
    pairs = [tuple(c.strip() for c in line.split("|")[3:5]) for line in markdown.splitlines()
             if line.startswith("| ARC-C") and " points" not in line and line.count("|") > 10]
    assert ("shared_weights", "bitune") in pairs and ("shared_weights", "lora") in pairs
    assert ("lora", "bitune") not in pairs  # only ablations are compared with the method
    row = next(line for line in markdown.splitlines() if "| shared_weights | bitune |" in line)
    assert "-4.0 [" in row


def test_bitune_is_paired_against_the_fair_baselines():
    from bitune.eval.report import build_markdown

    records = [paired_record("lora", 42, [1] * 20 + [0] * 80), paired_record("bitune", 42, [1] * 30 + [0] * 70),
               paired_record("lora16", 42, [1] * 24 + [0] * 76), paired_record("lora_compute", 42, [1] * 33 + [0] * 67)]
    _, markdown, _ = build_markdown(records)
    rows = {tuple(c.strip() for c in line.split("|")[3:5]): line for line in markdown.splitlines()
            if line.startswith("| ARC-C") and line.count("|") > 10}
    assert "+6.0 [" in rows[("bitune", "lora16")] and "-3.0 [" in rows[("bitune", "lora_compute")]
    assert ("lora16", "lora") in rows and ("lora_compute", "lora") in rows  # and each against LoRA r8
    assert ("lora16", "bitune") not in rows  # shown once, as bitune vs the baseline


def test_report_shows_n_limit_and_intervals_and_writes_next_to_the_runs(tmp_path):
    runs = tmp_path / "study"
    write_runs(runs, [paired_record("lora", 42, [1, 0] * 10, limit=20),
                      paired_record("bitune", 42, [1, 1, 0, 1] * 5, limit=20)])
    assert main(["report", str(runs)]) == 0  # no --output: next to the runs, not the current folder
    md = (runs / "report.md").read_text()
    assert (runs / "report.csv").is_file() and (runs / "report.png").stat().st_size > 1000
    assert "Questions per task (n): ARC-C 20; --limit: 20" in md
    assert "| ARC-C | 20 | 20 | lora | 1 | 50.0 [" in md
    assert "| ARC-C | 20 | bitune | lora | 1 (question-level only) | +25.0 [" in md
    assert "**Warning: one seed pair** (bitune vs lora on ARC-C)" in md  # the test cannot see seed variation
    assert "GSM8K" not in md


def test_report_is_reproducible_to_the_byte(tmp_path):
    runs = tmp_path / "r"
    rng = __import__("numpy").random.default_rng(0)
    write_runs(runs, [paired_record(m, s, (rng.random(300) < p).astype(int).tolist())
                      for m, p in (("lora", 0.3), ("bitune", 0.35)) for s in (42, 43, 44)])
    assert main(["report", str(runs), "--output", str(tmp_path / "a"), "--no-figure"]) == 0
    assert main(["report", str(runs), "--output", str(tmp_path / "b"), "--no-figure"]) == 0
    assert (tmp_path / "a" / "report.md").read_bytes() == (tmp_path / "b" / "report.md").read_bytes()
    assert not (tmp_path / "a" / "report.png").exists()


def test_report_refuses_runs_on_different_questions(tmp_path, capsys):
    runs = tmp_path / "r"
    write_runs(runs, [paired_record("lora", 42, [1, 0, 1]), paired_record("bitune", 42, [1, 0])])
    assert main(["report", str(runs)]) == 2
    assert "different --limit" in capsys.readouterr().err


@pytest.mark.parametrize("broken, message", [
    ({"schema": SCHEMA, "label": "lora", "tasks": {"piqa": {"acc": 0.5}}}, "field 'config'"),
    ({"schema": SCHEMA, "label": 3, "tasks": {}, "config": {}}, "field 'label'"),
    ({"schema": SCHEMA, "label": "x", "tasks": {"piqa": 0.5}, "config": {}}, "tasks.piqa"),
])
def test_hand_edited_eval_json_is_one_clear_error(tmp_path, capsys, broken, message):
    (tmp_path / "eval.json").write_text(json.dumps(broken))
    assert main(["report", str(tmp_path / "eval.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and "eval.json" in err and "Traceback" not in err


def _cut(r):
    r["samples"]["arc_challenge"] = {k: v[:2] for k, v in r["samples"]["arc_challenge"].items()}


def _rotate(r):
    table = r["samples"]["arc_challenge"]
    table["doc_id"] = table["doc_id"][1:] + table["doc_id"][:1]


def _gold(r):
    r["samples"]["arc_challenge"]["gold"][2] = 3


@pytest.mark.parametrize("edit, message", [
    (_cut, "2 questions, but tasks.arc_challenge.n is 4"),
    (lambda r: r["samples"]["arc_challenge"]["acc"].pop(), "lists differ in length"),
    (lambda r: r["samples"]["arc_challenge"]["doc_id"].__setitem__(1, 0), "doc_id 0 appears more than once"),
    (lambda r: r["samples"]["arc_challenge"]["doc_id"].__setitem__(1, "1"), "not an integer"),
    (lambda r: r["samples"]["arc_challenge"]["acc"].__setitem__(0, 2.0), "acc[0] is 2.0"),
    (lambda r: r["samples"]["arc_challenge"]["acc"].__setitem__(0, float("nan")), "acc[0] is nan"),
    (lambda r: r["samples"]["arc_challenge"]["acc"].__setitem__(1, 1.0), "its mean 0.750000 is not"),
    (lambda r: r["tasks"]["arc_challenge"].__setitem__("acc", "high"), "metric 'acc' is 'high'"),
    (_rotate, "disagree on the correct answer of 4 questions"),
    (_gold, "disagree on the correct answer of 1 questions (the first: doc_id 2)"),
])
def test_an_edited_or_cut_per_question_table_is_one_clear_error(tmp_path, capsys, edit, message):
    """A per-question table that no longer matches its questions or its own summary would pair the wrong
    questions silently: refused, naming the file or run and the place."""
    def run(label, correct):
        r = paired_record(label, 42, correct)
        r["samples"]["arc_challenge"]["gold"] = [0, 1, 2, 3]
        return r

    runs, edited = tmp_path / "r", run("bitune", [1, 0, 0, 1])
    write_runs(runs, [run("lora", [1, 1, 0, 1]), edited])
    assert main(["report", str(runs), "--no-figure", "--output", str(tmp_path / "ok")]) == 0  # unedited: fine
    edit(edited)
    write_runs(runs, [edited])
    assert main(["report", str(runs), "--no-figure", "--output", str(tmp_path / "edited")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_several_inputs_need_an_output_folder(tmp_path, capsys):
    for name in ("a", "b"):
        write_runs(tmp_path / name, [paired_record("lora", 42, [1, 0])])
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "--output" in capsys.readouterr().err


def test_embed_replaces_only_the_marked_block(tmp_path, capsys):
    from bitune.eval.report import EMBED_BEGIN, EMBED_END

    runs = tmp_path / "r"
    write_runs(runs, [paired_record("lora", 42, [1, 0] * 10), paired_record("bitune", 42, [1, 1] * 10)])
    doc = tmp_path / "README.md"
    doc.write_text(f"# Study\n\nBefore.\n\n{EMBED_BEGIN}\nold table\n{EMBED_END}\n\nAfter.\n")
    assert main(["report", str(runs), "--embed", str(doc), "--no-figure"]) == 0
    text = doc.read_text()
    assert text.startswith("# Study\n\nBefore.\n\n") and text.endswith(f"{EMBED_END}\n\nAfter.\n")
    assert "old table" not in text and "### Report: ARC-C: acc" in text and "| ARC-C | 20 | bitune | lora |" in text
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    (runs / "report.md").unlink()
    assert main(["report", str(runs), "--embed", str(plain)]) == 2
    assert "begin" in capsys.readouterr().err and plain.read_text() == "no markers\n"
    assert not (runs / "report.md").exists()  # nothing written when an --embed target is unusable


def test_embed_summary_shows_accuracies_trivial_baselines_and_bitune_differences(tmp_path, capsys):
    """The README's short form: each method's accuracy with its interval next to the best trivial baseline (a method
    under it marked), then Bitune minus each baseline with the two-level interval and the full report's Holm p; the
    full report it summarises is linked relative to the document; nothing else in the document changes."""
    from bitune.eval.report import SUMMARY_BEGIN, SUMMARY_END

    def run(label, correct):
        r = paired_record(label, 42, correct)
        r["samples"]["arc_challenge"]["gold"] = [1] * len(correct)  # always choice 1 is right on every question
        r["samples"]["arc_challenge"]["loglik"] = [[-1.0, -2.0, -3.0]] * len(correct)  # 3 choices each
        return r

    runs = tmp_path / "r"
    write_runs(runs, [run("lora", [1, 0] * 10), run("bitune", [1, 1] * 10)])
    doc = tmp_path / "docs" / "README.md"
    doc.parent.mkdir()
    doc.write_text(f"Before.\n{SUMMARY_BEGIN}\nold\n{SUMMARY_END}\nAfter.\n")
    assert main(["report", str(runs), "--embed-summary", str(doc), "--no-figure"]) == 0
    text = doc.read_text()
    assert text.startswith(f"Before.\n{SUMMARY_BEGIN}\n") and text.endswith(f"{SUMMARY_END}\nAfter.\n")
    assert "old" not in text and "### Summary: ARC-C: acc" in text
    # the best trivial baseline (always choice 1) scores 100% here: LoRA's 50% is marked below it, Bitune's 100% not
    row = next(line for line in text.splitlines() if line.startswith("| ARC-C | 20 | 100.0 | "))
    bitune, lora = row.split(" | ")[3:5]  # methods by name (no report.yaml)
    assert lora.startswith("50.0 [") and lora.endswith("(below) |")
    assert bitune == "100.0 [100.0, 100.0]" and text.count("(below)") == 2  # the legend + LoRA
    row = next(line for line in text.splitlines() if line.startswith("| ARC-C | +50.0 ["))
    assert "Holm p" in row  # bitune minus lora: +50 points on the same 20 questions
    assert row.endswith("(1 seed pair) |")  # one run per method: the interval does not cover training seeds
    assert "[../r/report.md](../r/report.md)" in text
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    assert main(["report", str(runs), "--embed-summary", str(bare)]) == 2
    assert "summary: begin" in capsys.readouterr().err and bare.read_text() == "no markers\n"


def test_embed_summary_marks_only_comparisons_that_rest_on_one_seed_pair(tmp_path):
    """A study that fills run by run: a task where each method has one seed is marked (its interval covers
    questions, not training seeds), a task with two seed pairs is not, and their pooled cell names the one-seed
    task."""
    from bitune.eval.report import SUMMARY_BEGIN, SUMMARY_END

    runs = tmp_path / "r"
    write_runs(runs / "csqa", [paired_record(m, s, c, task="csqa") for s in (42, 43)
                               for m, c in [("lora", [1, 0] * 10), ("bitune", [1, 1] * 10)]])
    write_runs(runs / "arc_easy", [paired_record(m, 42, c, task="arc_easy")
                                   for m, c in [("lora", [0, 1] * 10), ("bitune", [1, 1] * 10)]])
    doc = tmp_path / "README.md"
    doc.write_text(f"{SUMMARY_BEGIN}\n{SUMMARY_END}\n")
    assert main(["report", str(runs), "--embed-summary", str(doc), "--no-figure"]) == 0
    rows = {line.split(" | ")[0]: line for line in doc.read_text().splitlines() if "Holm p" in line}
    assert rows["| ARC-E"].endswith("(1 seed pair) |")
    assert "seed pair" not in rows["| CSQA"]
    assert rows["| pooled: ARC-E + CSQA"].endswith("(1 seed pair on ARC-E) |")


def test_runs_trained_per_task_count_once_per_seed_and_average_over_tasks():
    recs = [record("lora", 42, 0.70, 0.30), record("lora", 43, 0.74, 0.34)]
    split = []
    for r in recs:  # the same runs, as a study that trains per task writes them: one eval JSON per task
        for task, metrics in r["tasks"].items():
            split.append({**r, "tasks": {task: metrics}})
    whole, per_task = aggregate(recs), aggregate(split)
    assert per_task.runs == whole.runs == {"lora": 2}
    assert per_task.cells["lora"]["avg"].values == pytest.approx(whole.cells["lora"]["avg"].values)
    assert per_task.rows() == whole.rows()
    pretrained = aggregate([record("pretrained", None, 0.6, 0.2)] + [record("pretrained", None, 0.6, 0.2)])
    assert pretrained.runs == {"pretrained": 2}  # two runs on the same tasks stay two runs


@pytest.mark.parametrize("key, values, what", [
    ("model", ("smollm2-135m", "gemma3-270m"), "base model"),
    ("template", ("paper", "chat"), "prompt template"),
    ("limit", (None, 20), "--limit"),
])
def test_report_refuses_runs_of_different_settings(tmp_path, capsys, key, values, what):
    """Runs of two base models (or templates, or question cuts) are never paired or averaged as seeds."""
    records = [paired_record("lora", 42, [1, 0] * 10), paired_record("bitune", 42, [1, 1] * 10)]
    for record, value in zip(records, values):
        record["config"][key] = value
    runs = tmp_path / "r"
    write_runs(runs, records)
    assert main(["report", str(runs)]) == 2
    err = capsys.readouterr().err
    assert f"differ in {what}" in err and repr(values[0]) in err and repr(values[1]) in err
    assert "lora (seed 42)" in err and "bitune (seed 42)" in err


# ------------------------------------------------------------------------------ the study's own report settings
def test_a_study_report_yaml_orders_the_methods_and_names_the_fair_baselines(tmp_path, capsys):
    """The library knows no study's method names: without report.yaml methods appear by name and bitune is paired
    with every other method; a study's report.yaml (in the runs' folder or above) sets the order and the pairs."""
    from bitune.eval.report import SETTINGS_FILE

    runs = tmp_path / "study" / "arc"
    write_runs(runs, [paired_record(m, 42, [1] * k + [0] * (20 - k))
                      for m, k in (("lora", 10), ("bitune", 14), ("lora16", 11), ("extra", 9))])

    def report():
        assert main(["report", str(runs), "--no-figure"]) == 0
        md = (runs / "report.md").read_text()
        table = md.split("mean ± sample std over seeds")[1].split("##")[0]
        rows = [line.split(" | ")[0].strip("| ") for line in table.splitlines() if line.startswith("| ")][1:]
        pairs = {tuple(c.strip() for c in line.split("|")[3:5]) for line in md.splitlines()
                 if line.startswith("| ARC-C") and line.count("|") > 10}
        return rows, pairs

    rows, pairs = report()
    assert rows == ["bitune", "extra", "lora", "lora16"]
    assert {("bitune", "extra"), ("bitune", "lora16"), ("bitune", "lora")} <= pairs
    (tmp_path / "study" / SETTINGS_FILE).write_text("methods: [lora, lora16, bitune]\nfair_baselines: [lora16]\n")
    rows, pairs = report()
    assert rows == ["lora", "lora16", "bitune", "extra"]
    assert ("bitune", "lora16") in pairs and ("bitune", "extra") not in pairs and ("extra", "lora") in pairs
    assert f"method order and fair baselines from {tmp_path / 'study' / SETTINGS_FILE}" in capsys.readouterr().out


def test_a_study_report_yaml_adds_further_comparisons_into_holms_family(tmp_path):
    """Two arms of one baseline that differ in one factor (LoRA given Bitune's compute on the same questions or on
    new ones) are compared directly when report.yaml's `pairs` names them, and Holm's family grows by it."""
    from bitune.eval.report import SETTINGS_FILE

    runs = tmp_path / "study" / "arc"
    write_runs(runs, [paired_record(m, 42, [1] * k + [0] * (40 - k))
                      for m, k in (("lora", 10), ("bitune", 14), ("lora_compute", 18), ("lora_compute_newdata", 12))])
    (tmp_path / "study" / SETTINGS_FILE).write_text("fair_baselines: [lora_compute]\n")

    def rows():
        assert main(["report", str(runs), "--no-figure"]) == 0
        md = (runs / "report.md").read_text()
        found = {tuple(c.strip() for c in line.split("|")[3:5]): line for line in md.splitlines()
                 if line.startswith("| ARC-C") and line.count("|") > 10}
        return found, int(re.search(r"family of all (\d+) comparisons", md).group(1))

    before, family = rows()
    assert ("lora_compute_newdata", "lora_compute") not in before
    (tmp_path / "study" / SETTINGS_FILE).write_text("fair_baselines: [lora_compute]\n"
                                                    "pairs: [[lora_compute_newdata, lora_compute]]\n")
    after, grown = rows()
    assert "-15.0 [" in after[("lora_compute_newdata", "lora_compute")]  # 12/40 - 18/40
    assert grown == family + 1 and set(before) < set(after)


def test_a_study_report_yaml_names_the_folders_its_report_reads(tmp_path):
    """A study that keeps runs on another split beside its reported ones (a tuning/ folder) names its report's
    folders in report.yaml: `bitune report STUDY` reads only those (a missing one is refused: tests/test_hardening.py)."""
    from bitune.eval.report import SETTINGS_FILE

    study = tmp_path / "study"
    write_runs(study / "arc", [paired_record(m, 42, [1] * k + [0] * (20 - k)) for m, k in (("lora", 10),
                                                                                             ("bitune", 14))])
    write_runs(study / "tuning" / "arc", [paired_record("lora_lr1e-3", 42, [1] * 5 + [0] * 15)])
    (study / SETTINGS_FILE).write_text("runs: [arc]\n")
    assert main(["report", str(study), "--no-figure"]) == 0
    md = (study / "report.md").read_text()
    assert "| bitune " in md and "lora_lr1e-3" not in md
    (study / SETTINGS_FILE).write_text("")  # without it, every run below the folder
    assert main(["report", str(study), "--no-figure"]) == 0
    assert "lora_lr1e-3" in (study / "report.md").read_text()


@pytest.mark.parametrize("text, message", [
    ("method: [lora]\n", "unknown setting 'method' (did you mean 'methods'?)"),
    ("runs: [../other]\n", "'../other' is not a folder inside the study's folder"),
    ("runs: arc\n", "report setting runs: a list of folder names"),
    ("methods: lora\n", "report setting methods: a list of method names"),
    ("methods: [lora, lora]\n", "'lora' is named twice"),
    ("- lora\n", "a mapping of report settings"),
    ("pairs: [lora, bitune]\n", "report setting pairs: each a [method, baseline] pair of two method names"),
    ("pairs: [[lora, lora]]\n", "compares a method with itself"),
    ("pairs: lora\n", "report setting pairs: a list of [method, baseline] pairs"),
])
def test_a_bad_report_yaml_is_one_clear_error(tmp_path, capsys, text, message):
    write_runs(tmp_path, [paired_record("lora", 42, [1, 0])])
    (tmp_path / "report.yaml").write_text(text)
    assert main(["report", str(tmp_path), "--no-figure"]) == 2
    err = capsys.readouterr().err
    assert message in err and "report.yaml" in err and not (tmp_path / "report.md").exists()


# ------------------------------------------------------------------ nothing written before the command can finish
def _out_of_order(doc, begin, end):
    doc.write_text(f"Before.\n{end}\nold\n{begin}\nAfter.\n")


def _end_missing(doc, begin, end):
    doc.write_text(f"Before.\n{begin}\nold\nAfter.\n")


def _read_only(doc, begin, end, monkeypatch):
    import os

    doc.write_text(f"Before.\n{begin}\nold\n{end}\nAfter.\n")
    doc.chmod(0o444)
    access = os.access  # root may write anyway: the check answers as it would for any other user
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if (mode & os.W_OK and os.path.abspath(p) ==
                                                                       str(doc)) else access(p, mode, **kw))


@pytest.mark.parametrize("option", ["--embed", "--embed-summary"])
@pytest.mark.parametrize("problem, message, not_in", [
    ("out of order", "markers are out of order", "add the line"),
    ("end missing", "add the line '<!-- bitune report", "begin"),
    ("read-only", "not writable", "add the line"),
])
def test_an_unusable_embed_target_stops_the_report_before_anything_is_written(tmp_path, capsys, monkeypatch,
                                                                               option, problem, message, not_in):
    """A README the report cannot go into (markers out of order or missing, the file read-only) is found before
    report.md, report.csv, report.png or another document are written; the error names what is wrong, and never
    asks to add a line that is already there."""
    from bitune.eval.report import EMBED_BEGIN, EMBED_END, SUMMARY_BEGIN, SUMMARY_END

    begin, end = (EMBED_BEGIN, EMBED_END) if option == "--embed" else (SUMMARY_BEGIN, SUMMARY_END)
    runs, good, bad = tmp_path / "r", tmp_path / "good.md", tmp_path / "bad.md"
    write_runs(runs, [paired_record("lora", 42, [1, 0] * 10), paired_record("bitune", 42, [1, 1] * 10)])
    good.write_text(f"{EMBED_BEGIN}\nold\n{EMBED_END}\n")
    if problem == "read-only":
        _read_only(bad, begin, end, monkeypatch)
    else:
        {"out of order": _out_of_order, "end missing": _end_missing}[problem](bad, begin, end)
    before = bad.read_text()
    assert main(["report", str(runs), "--embed", str(good), option, str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and not_in not in err.split(str(bad))[1], err
    assert sorted(p.name for p in runs.iterdir()) == ["bitune-42", "lora-42"]  # no report.md/.csv/.png
    assert good.read_text() == f"{EMBED_BEGIN}\nold\n{EMBED_END}\n" and bad.read_text() == before


# ------------------------------------------------------------------------- no comparison dropped without a word
def test_a_comparison_without_a_common_seed_is_named_in_the_report_and_on_stderr(tmp_path, capsys):
    """bitune on seeds 42, 43 and lora on 44, 45 cannot be paired: the report says so once (report.md, the README
    summary, stderr) instead of leaving the comparison out silently; the comparisons that can be made are made."""
    from bitune.eval.report import SUMMARY_BEGIN, SUMMARY_END

    runs, doc = tmp_path / "r", tmp_path / "README.md"
    write_runs(runs, [paired_record("bitune", s, [1, 1, 0, 1] * 5) for s in (42, 43)]
               + [paired_record("lora", s, [1, 0] * 10) for s in (44, 45)]
               + [paired_record("pretrained", None, [0, 0, 1, 0] * 5)])
    doc.write_text(f"{SUMMARY_BEGIN}\n{SUMMARY_END}\n")
    assert main(["report", str(runs), "--no-figure", "--embed-summary", str(doc)]) == 0
    named = "bitune vs lora on ARC-C (bitune seeds 42, 43; lora seeds 44, 45)"
    err = capsys.readouterr().err
    assert err.count(named) == 1 and "not compared" in err
    md = (runs / "report.md").read_text()
    assert md.count(named) == 1 and "Not compared (no training seed in common" in md
    assert "| ARC-C | 20 | bitune | pretrained | 2 |" in md and "| ARC-C | 20 | lora | pretrained | 2 |" in md
    assert doc.read_text().count(named) == 1


def test_an_untrained_method_is_paired_with_a_trained_baseline(tmp_path):
    """``--baselines lora`` with a pretrained run: the pretrained model against every LoRA seed, not left out."""
    runs = tmp_path / "r"
    write_runs(runs, [paired_record("lora", s, [1, 0] * 10) for s in (42, 43)]
               + [paired_record("pretrained", None, [0, 0, 1, 0] * 5)])
    assert main(["report", str(runs), "--no-figure", "--baselines", "lora"]) == 0
    md = (runs / "report.md").read_text()
    assert "| ARC-C | 20 | pretrained | lora | 2 | -25.0 [" in md and "Not compared" not in md


def test_report_says_which_test_decides_and_what_it_costs_at_three_seeds():
    """The paired-differences text names the seed-aware test as the one that decides and gives the t a
    difference needs with 3 seed pairs: 4.3 standard errors at 5% alone (2 degrees of freedom), more at Holm's
    smallest threshold over the report's family."""
    from scipy.stats import t

    from bitune.eval.report import analyse, build_markdown, build_summary

    rng = np.random.default_rng(0)
    records = [paired_record(m, s, (rng.random(200) < 0.5).astype(int).tolist())
               for m in ("lora", "bitune") for s in (42, 43, 44)]
    records.append(paired_record("pretrained", None, (rng.random(200) < 0.5).astype(int).tolist()))
    a = analyse(records)
    _, markdown, _ = build_markdown(records, analysis=a)
    m = len(a.adjusted)
    cost = ("with 3 seed pairs the t has 2 degrees of freedom, so a difference is resolved at 5% alone only beyond "
            "4.3 standard errors")
    holm = f"at Holm's smallest threshold here (0.05/{m}) beyond {t.ppf(1 - 0.025 / m, 2):.1f}."
    assert "Seed-aware, the test that decides" in markdown and cost in markdown and holm in markdown
    summary = build_summary(a)
    assert "the test that decides" in summary and cost in summary
