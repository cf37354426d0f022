"""Committed studies: ``bitune report`` on the committed eval files reproduces the committed report exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from bitune.eval.report import build_markdown, find_results, load_records

RESULTS = Path(__file__).resolve().parents[1] / "results"
STUDIES = sorted(p.parent for p in RESULTS.glob("*/report.md"))


def test_there_is_a_committed_study():
    assert STUDIES, f"no results/*/report.md under {RESULTS}"


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_report_reproduces_from_the_committed_eval_files(study):
    records = load_records(find_results([str(study)]))
    _, markdown, tasks = build_markdown(records)
    assert markdown == (study / "report.md").read_text(encoding="utf-8")
    assert tasks, "the committed runs carry per-question results"
    for task in tasks.values():
        assert task.limit is None  # evaluated on the full split


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.name)
def test_study_readme_shows_exactly_the_committed_report(study):
    from bitune.eval.report import EMBED_BEGIN, EMBED_END, embedded

    text = (study / "README.md").read_text(encoding="utf-8")
    block = text[text.index(EMBED_BEGIN) + len(EMBED_BEGIN):text.index(EMBED_END)]
    assert block == "\n" + embedded((study / "report.md").read_text(encoding="utf-8"))
