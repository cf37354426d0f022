"""TRL's dataset rows as Bitune samples: a prompt's and its answer's tokens, apart.

TRL's ``SFTTrainer`` reads three row formats Bitune can learn from:

- prompt-completion: ``{"prompt": str, "completion": str}``; the prompt is used verbatim (template ``"none"``),
- conversational: ``{"messages": [{"role", "content"}, ...]}``; the last assistant turn is the answer and the
  turns before it the prompt (template ``"chat"``),
- conversational prompt-completion: ``{"prompt": [turns], "completion": [one assistant turn]}``, the same
  conversation split where the row splits it.

Each row is tokenized by :func:`bitune.data.collate.tokenize_dataset`, the code ``bitune train`` runs, so the
tokens are those of ``bitune train`` on the same rows: a verbatim prompt with the tokenizer's special tokens and
the answer followed by eos; a conversation rendered with the chat template, the answer ended by the end-of-turn
token. A sample keeps them apart, as the :data:`COLUMNS` ``prompt_ids`` and ``answer_ids``, which
:class:`bitune.data.collate.Collator` pads into the model's left-padded prompts and right-padded answers. Samples
longer than ``max_length`` are dropped, never truncated (a truncated answer would lose its end).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..data.collate import tokenize_dataset
from ..data.conversations import ChatExample, chat_example
from ..data.templates import Example
from ..errors import BituneError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

COLUMNS = ("prompt_ids", "answer_ids")
"""The columns of a tokenized dataset: the token lists :class:`bitune.data.collate.Collator` batches."""
FORMATS = "'prompt'/'completion' or 'messages' rows"


def row_format(columns: Iterable[str], name: str) -> str:
    """``"messages"`` or ``"prompt_completion"``: the format of a dataset with these columns.

    Raises:
        BituneError: naming the field: plain ``text`` rows (no prompt/answer split), prompts without a
            ``completion``, pre-tokenized rows, or none of the fields Bitune trains on.
    """
    columns = set(columns)
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "prompt" in columns:
        raise BituneError(f"{name} dataset: field 'prompt' without a field 'completion' (prompt-only rows): Bitune "
                          f"learns the answer to each prompt; give {FORMATS}")
    if "text" in columns:
        raise BituneError(f"{name} dataset: field 'text' is plain language-modeling text, with no prompt/answer "
                          f"split: Bitune reads a prompt twice and learns its answer; give {FORMATS}")
    if "input_ids" in columns:
        raise BituneError(f"{name} dataset: pre-tokenized rows (field 'input_ids') are not taken: give {FORMATS}, "
                          "which are tokenized exactly as bitune train tokenizes them")
    raise BituneError(f"{name} dataset: has fields {sorted(columns)}, none of 'prompt'/'completion' or 'messages': "
                      f"give {FORMATS}")


def row_example(row: dict, n: int, fmt: str, name: str, eos_token: str | None) -> Example | ChatExample:
    """One row as the example ``bitune train`` would make of it.

    Args:
        row: the dataset row.
        n: its index in the dataset (named in errors).
        fmt: from :func:`row_format`.
        name: ``"train"`` or ``"eval"`` (named in errors).
        eos_token: the tokenizer's eos text; one trailing copy is taken off a text completion (TRL appends it
            when missing, Bitune appends the eos token itself).

    Raises:
        BituneError: naming the row and field.
    """
    where = f"{name} dataset row {n}"
    if fmt == "messages":
        return _chat(row, n, name, "messages")
    prompt, completion = row.get("prompt"), row.get("completion")
    if isinstance(prompt, list):
        if not (isinstance(completion, list) and len(completion) == 1 and isinstance(completion[0], dict)
                and completion[0].get("role") == "assistant"):
            raise BituneError(f"{where} field 'completion' must be one assistant turn "
                              "[{'role': 'assistant', 'content': ...}] after a conversational prompt")
        return _chat({"messages": [*prompt, *completion]}, n, name, "prompt' + 'completion")
    if not isinstance(prompt, str):
        raise BituneError(f"{where} field 'prompt' must be a string or a list of turns, got {type(prompt).__name__}")
    if not isinstance(completion, str):
        problem = "is missing" if completion is None else f"must be a string, got {type(completion).__name__}"
        raise BituneError(f"{where} field 'completion' {problem}")
    if eos_token and completion.endswith(eos_token):
        completion = completion[:-len(eos_token)]
    return Example(prompt=prompt, answer=completion, template="none", id=f"{n} of the {name} dataset (field 'prompt')")


def _chat(row: dict, n: int, name: str, field: str) -> ChatExample:
    """A conversation checked as ``bitune train`` checks ``messages`` rows (errors name the row and field)."""
    example = chat_example(row, f"{name} dataset", n)
    return dataclasses.replace(example, id=f"{n} of the {name} dataset (field '{field}')")


def tokenize_rows(rows, tokenizer: PreTrainedTokenizerBase, max_length: int | None,
                  name: str = "train") -> tuple[list[dict], int, str]:
    """Tokenize a dataset's rows as ``bitune train`` does.

    Args:
        rows: a ``datasets.Dataset`` (or any sized iterable of dict rows with ``column_names``-like keys).
        tokenizer: the model's tokenizer.
        max_length: longest prompt + answer kept, in tokens (None: no limit); longer samples are dropped.
        name: which dataset, for errors.

    Returns:
        ``(samples, dropped, template)``: ``{"prompt_ids", "answer_ids"}`` per kept row in order (the answer ends
        with eos or the end-of-turn token), how many rows were too long, and the template of the rows (``"chat"``
        or ``"none"``).

    Raises:
        BituneError: a row Bitune cannot use (see :func:`row_format`, :func:`row_example`), a prompt under 2
            tokens (naming the row), or every row longer than ``max_length``.
    """
    columns = getattr(rows, "column_names", None)
    if columns is None:
        raise BituneError(f"{name} dataset must be a datasets.Dataset (streaming datasets are not supported), "
                          f"got {type(rows).__name__}")
    fmt = row_format(columns, name)
    examples = [row_example(row, n, fmt, name, tokenizer.eos_token) for n, row in enumerate(rows)]
    if not examples:
        raise BituneError(f"{name} dataset is empty")
    samples, dropped = tokenize_dataset(tokenizer, examples, sys.maxsize if max_length is None else max_length)
    if not samples:
        raise BituneError(f"all {len(examples)} rows of the {name} dataset are longer than max_length={max_length} "
                          "tokens; raise max_length")
    return samples, dropped, "chat" if isinstance(examples[0], ChatExample) else "none"


__all__ = ["COLUMNS", "row_format", "row_example", "tokenize_rows"]
