"""The paper's templates render exactly the strings of the authors' code."""

import pytest

from bitune.data.templates import (
    arc_example,
    gsm8k_example,
    instruction_example,
    mmlu_example,
    piqa_example,
    siqa_example,
)
from bitune.errors import BituneError


def test_instruction_without_input():
    ex = instruction_example("Name a color.", "", "Blue.")
    assert ex.prompt == "Question: Name a color.\n\nAnswer:"
    assert ex.answer == " Blue."
    assert ex.choices is None and ex.gold is None


def test_instruction_with_input():
    ex = instruction_example("Translate to French.", "Good morning", "Bonjour", id="7")
    assert ex.prompt == "Question: Translate to French.\nGood morning\n\nAnswer:"
    assert ex.answer == " Bonjour"
    assert ex.id == "7"


def test_arc_and_csqa():
    ex = arc_example("Which is a metal?", ["wood", "iron", "glass"], 1, id="q1")
    assert ex.prompt == "Question: Which is a metal?\n\nChoices:\nwood\niron\nglass\n\nAnswer:"
    assert ex.choices == [" wood", " iron", " glass"]
    assert ex.answer == " iron" == ex.choices[ex.gold]


def test_piqa():
    ex = piqa_example("Open a jar.", "Twist the lid.", "Shake it.", 0)
    assert ex.prompt == "Question: Open a jar.\n\nChoices:\nTwist the lid.\nShake it.\n\nAnswer:"
    assert ex.choices == [" Twist the lid.", " Shake it."]
    assert ex.answer == " Twist the lid."


def test_siqa():
    ex = siqa_example("Ann won.", "How does Ann feel?", ["sad", "happy", "bored"], 1)
    assert ex.prompt == (
        "Question: Given the context, answer correctly the question.\n"
        "Context: Ann won.\nQuestion: How does Ann feel?\n\n"
        "Choices:\n(0) sad\n(1) happy\n(2) bored\n\nAnswer:"
    )
    assert ex.choices == [" (0)", " (1)", " (2)"]
    assert ex.answer == " (1)"


def test_mmlu_strips_question():
    ex = mmlu_example(" What is 2+2? ", ["3", "4", "5", "6"], 1)
    assert ex.prompt == "Question: What is 2+2?\n(0). 3\n(1). 4\n(2). 5\n(3). 6\n\nAnswer:"
    assert ex.choices == [" (0)", " (1)", " (2)", " (3)"]
    assert ex.answer == " (1)"


def test_gsm8k_keeps_rationale_and_number():
    ex = gsm8k_example("What is 3*4?", "3 * 4 = <<3*4=12>>12\n#### 12", id="0")
    assert ex.prompt == "Question: What is 3*4?\n\nAnswer:"
    assert ex.answer == " 3 * 4 = <<3*4=12>>12\n#### 12"
    assert ex.target == "12"


def test_gsm8k_without_final_answer_is_rejected():
    with pytest.raises(BituneError, match="####"):
        gsm8k_example("q", "no final line", id="3")


def test_gold_out_of_range_is_rejected():
    with pytest.raises(BituneError, match="gold index 2"):
        piqa_example("g", "a", "b", 2, id="x")
