"""The paper's prompt templates: one function per task turns a raw record into an :class:`Example`.

Every prompt ends with ``"Answer:"`` and every answer starts with a space, as in the authors'
code. Fields are rendered exactly as given (only MMLU questions are stripped, as the authors'
MMLU task does); the eos token is appended later, at tokenization.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import BituneError


@dataclass
class Example:
    """One prompt with its reference answer."""

    prompt: str
    """Text the model conditions on, ending in ``"Answer:"``."""
    answer: str
    """Reference continuation, starting with a space; the training target."""
    choices: list[str] | None = None
    """Multiple-choice tasks: every candidate continuation (each starting with a space)."""
    gold: int | None = None
    """Multiple-choice tasks: index of the correct choice, so ``answer == choices[gold]``."""
    id: str | None = None
    """Identifier of the source record, when it has one."""
    target: str | None = None
    """Short reference answer for generative tasks (the number after ``####`` for GSM8K)."""
    template: str = "paper"
    """How ``prompt`` is written (see ``bitune.config.TEMPLATES``): ``"paper"`` (these templates) or ``"none"`` (a
    user's verbatim prompt); training records it in the checkpoint so generation writes prompts the same way."""


def _multiple_choice(prompt: str, choices: list[str], gold: int, id: str | None) -> Example:
    if not 0 <= gold < len(choices):
        raise BituneError(f"record {id}: gold index {gold} is out of range for {len(choices)} choices")
    return Example(prompt=prompt, answer=choices[gold], choices=choices, gold=gold, id=id)


def instruction_example(instruction: str, input: str | None, output: str, id: str | None = None) -> Example:
    """Alpaca-style record: ``Question: {instruction}[\\n{input}]\\n\\nAnswer:`` + `` {output}``."""
    question = f"{instruction}\n{input}" if input else instruction
    return Example(prompt=f"Question: {question}\n\nAnswer:", answer=f" {output}", id=id)


def arc_example(question: str, choices: Sequence[str], gold: int, id: str | None = None) -> Example:
    """ARC (and CSQA): the choice texts one per line; the target is the correct choice text."""
    lines = "\n".join(choices)
    prompt = f"Question: {question}\n\nChoices:\n{lines}\n\nAnswer:"
    return _multiple_choice(prompt, [f" {c}" for c in choices], gold, id)


csqa_example = arc_example


def piqa_example(goal: str, sol1: str, sol2: str, label: int, id: str | None = None) -> Example:
    """PIQA: two solutions; the target is the correct solution text."""
    prompt = f"Question: {goal}\n\nChoices:\n{sol1}\n{sol2}\n\nAnswer:"
    return _multiple_choice(prompt, [f" {sol1}", f" {sol2}"], label, id)


def siqa_example(context: str, question: str, answers: Sequence[str], gold: int, id: str | None = None) -> Example:
    """Social IQa: three numbered answers; the target is ``" (i)"`` with ``gold`` 0-based."""
    numbered = "\n".join(f"({i}) {a}" for i, a in enumerate(answers))
    prompt = (
        "Question: Given the context, answer correctly the question.\n"
        f"Context: {context}\nQuestion: {question}\n\nChoices:\n{numbered}\n\nAnswer:"
    )
    return _multiple_choice(prompt, [f" ({i})" for i in range(len(answers))], gold, id)


def mmlu_example(question: str, choices: Sequence[str], gold: int, id: str | None = None) -> Example:
    """MMLU: four numbered choices ``(i). text``; the target is ``" (i)"``."""
    numbered = "".join(f"\n({i}). {c}" for i, c in enumerate(choices))
    prompt = f"Question: {question.strip()}{numbered}\n\nAnswer:"
    return _multiple_choice(prompt, [f" ({i})" for i in range(len(choices))], gold, id)


_GSM8K_FINAL = re.compile(r"#### *(.+?)\s*$")


def gsm8k_example(question: str, answer: str, id: str | None = None) -> Example:
    """GSM8K: the target is the full rationale ending in ``#### N``; ``target`` keeps ``N``.

    Raises:
        BituneError: The rationale does not end in ``#### N``.
    """
    match = _GSM8K_FINAL.search(answer)
    if match is None:
        raise BituneError(f"GSM8K record {id}: answer does not end in '#### <number>'")
    return Example(
        prompt=f"Question: {question}\n\nAnswer:", answer=f" {answer}", id=id, target=match.group(1)
    )
