"""TRL's dataset rows as Bitune samples, and TRL's batches split back into prompts and answers.

TRL's ``SFTTrainer`` reads three row formats Bitune can learn from:

- prompt-completion: ``{"prompt": str, "completion": str}``; the prompt is used verbatim (template ``"none"``),
- conversational: ``{"messages": [{"role", "content"}, ...]}``; the last assistant turn is the answer and the
  turns before it the prompt (template ``"chat"``),
- conversational prompt-completion: ``{"prompt": [turns], "completion": [one assistant turn]}``, the same
  conversation split where the row splits it.

Each row is tokenized by :func:`bitune.data.collate.tokenize_dataset`, the code ``bitune train`` runs, so the
tokens are those of ``bitune train`` on the same rows: a verbatim prompt with the tokenizer's special tokens and
the answer followed by eos; a conversation rendered with the chat template, the answer ended by the end-of-turn
token. A sample becomes TRL's pre-tokenized form, ``input_ids`` = prompt + answer and ``labels`` = -100 on the
prompt, which TRL pads on the right; :func:`split_batch` turns such a batch back into the model's left-padded
prompts and right-padded answers. Samples longer than ``max_length`` are dropped, never truncated (a truncated
answer would lose its end).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from ..data.collate import tokenize_dataset
from ..data.conversations import ChatExample, chat_example
from ..data.templates import Example
from ..errors import BituneError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

IGNORE = -100
"""TRL's label for tokens outside the loss (the prompt and the padding)."""
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
        ``(samples, dropped, template)``: ``{"input_ids", "labels"}`` per kept row in order, how many rows were
        too long, and the template of the rows (``"chat"`` or ``"none"``).

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
    trl_samples = [{"input_ids": s["prompt_ids"] + s["answer_ids"],
                    "labels": [IGNORE] * len(s["prompt_ids"]) + s["answer_ids"]} for s in samples]
    return trl_samples, dropped, "chat" if isinstance(examples[0], ChatExample) else "none"


def split_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split TRL's right-padded batch at each row's first label that is not -100.

    Args:
        input_ids: (B, T) prompt + answer, right-padded.
        attention_mask: (B, T) 1 on real tokens (a prefix of each row).
        labels: (B, T) -100 on the prompt and the padding, the answer's ids on the answer.
        pad: id written into padded positions.

    Returns:
        ``prompt_ids, prompt_mask`` (B, P) left-padded and ``answer_ids, answer_mask`` (B, A) right-padded, as
        :class:`bitune.data.collate.Collator` makes them.

    Raises:
        BituneError: a row whose prompt is under 2 tokens, which has no answer, or whose labels are not one
            answer running to the end of the row (e.g. -100 inside it).
    """
    B, T = input_ids.shape
    pos = torch.arange(T, device=input_ids.device)  # (T,)
    length = attention_mask.sum(1)  # (B,)
    is_answer = labels != IGNORE  # (B, T)
    start = torch.where(is_answer.any(1), is_answer.int().argmax(1), length)  # (B,) first answer position
    real = pos[None] < length[:, None]  # (B, T)
    expected = real & (pos[None] >= start[:, None])  # (B, T) the answer: from start to the row's end
    bad = (~(attention_mask.bool() == real).all(1) | (start < 2) | (start >= length)
           | ~(is_answer == expected).all(1) | ~((labels == input_ids) | ~expected).all(1))
    if bad.any():
        i = int(bad.nonzero()[0])
        raise BituneError(f"batch row {i}: its labels are not a prompt of at least 2 tokens (labels -100) followed by "
                          f"one answer to the end of the row (labels = input_ids); got prompt {int(start[i])} "
                          f"token(s) of {int(length[i])}: a dataset row Bitune cannot use")
    P, A = int(start.max()), int((length - start).max())
    p_idx = pos[None, :P] - (P - start[:, None])  # (B, P) source position of each prompt slot, < 0 on padding
    prompt_mask = (p_idx >= 0).long()  # (B, P)
    prompt_ids = torch.where(p_idx >= 0, input_ids.gather(1, p_idx.clamp(min=0)), pad)  # (B, P)
    a_idx = start[:, None] + pos[None, :A]  # (B, A)
    answer_mask = (a_idx < length[:, None]).long()  # (B, A)
    answer_ids = torch.where(answer_mask.bool(), input_ids.gather(1, a_idx.clamp(max=T - 1)), pad)  # (B, A)
    return prompt_ids, prompt_mask, answer_ids, answer_mask


__all__ = ["IGNORE", "row_format", "row_example", "split_batch", "tokenize_rows"]
