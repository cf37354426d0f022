"""The project's texts say no more than their intervals (issue 64): none of the sentences an audit found claiming
more than the numbers support comes back in the README, the docs or a study's texts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXTS = sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md"),
                *(p for p in ROOT.glob("results/**/*.md")  # not the model cards of a study's runs in progress
                  if not any(part == "final" or part.startswith("checkpoint-") for part in p.parts))})
"""The project's texts: the README, the docs, the studies' texts (what .gitignore keeps out of a study's run folders,
its checkpoints' model cards, written and rotated while a run trains, is not one)."""

OVERCLAIMS = {
    "Not at the sizes this project can train": "an absence of evidence written as an absence of effect",
    "does not beat LoRA": "no difference resolved is not 'no advantage'",
    "gains LoRA as much as": "an equivalence claim with no margin fixed in advance",
    "Seeds matter as much as methods": "counts of disagreeing answers, and one method gap exceeds the seed spread",
    "intervals above cover both": "the old test's coverage was 92% and its tails several times nominal",
    "covers other training seeds and other questions": "a property the test is meant for, not one it has exactly",
    "does not carry to the held-out": "the interval allows a gain: 'not shown to carry'",
    "excludes 0 on its own": "at 2 degrees of freedom the interval touches 0",
    "counts it twice: conservative": "conservative in expectation, not as a test",
}
"""Phrase -> why it says more than its interval."""


def _texts_with(phrase: str, texts: list[Path] = TEXTS, root: Path = ROOT) -> list[str]:
    """The texts holding ``phrase``, case aside and wherever a line break falls inside it."""
    pattern = re.compile(r"\s+".join(map(re.escape, phrase.split())), re.IGNORECASE)
    return [str(path.relative_to(root)) for path in texts if pattern.search(path.read_text(encoding="utf-8"))]


def test_the_texts_are_found():
    names = {str(p.relative_to(ROOT)) for p in TEXTS}
    assert {"README.md", "docs/results.md", "docs/guides/evaluation.md",
            "results/qwen2.5-arc-easy-csqa/README.md"} <= names


@pytest.mark.parametrize("phrase", OVERCLAIMS)
def test_no_text_claims_more_than_its_interval(phrase):
    found = _texts_with(phrase)
    assert not found, f"{phrase!r} ({OVERCLAIMS[phrase]}) in {found}"


def test_the_check_finds_a_phrase_broken_over_lines(tmp_path):
    """The search is not defeated by a line break inside the phrase (the texts wrap at 120 columns)."""
    text = tmp_path / "README.md"
    text.write_text("At the paper's protocol Bitune does not\nbeat LoRA on this model.\n", encoding="utf-8")
    assert _texts_with("does not beat LoRA", [text], tmp_path) == ["README.md"]
    assert _texts_with("excludes 0 on its own", [text], tmp_path) == []
