"""``bitune report``: mean and sample std over seeds, the average column, Markdown/CSV output."""

from __future__ import annotations

import csv
import io
import json
import math

import pytest

from bitune.cli import main
from bitune.eval.cli import SCHEMA
from bitune.eval.report import aggregate


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
    assert rep.rows()[0][:3] == ["lora", "3", "72.00 ± 2.00"]
    assert rep.rows()[1][2] == "80.00 ± -"
    assert list(rep.cells) == ["lora", "bitune"]


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


def test_report_cli_fails_cleanly_without_results(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "no eval results" in capsys.readouterr().err
