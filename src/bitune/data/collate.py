"""Tokenization and batching of examples for :class:`bitune.BituneModel`.

The model takes the full prompt and the answer apart: ``prompt_ids`` (B, P) left-padded and
``answer_ids`` (B, A) right-padded, each with a mask (1 = real token). The model itself moves
the prompt's last token into the answer pass, so here a prompt is tokenized whole, with the
tokenizer's special tokens (a BOS where it adds one), and an answer without special tokens,
followed by the eos token. A conversation (:class:`~bitune.data.conversations.ChatExample`) is
rendered with the chat template instead: its prompt carries the template's own special tokens and
its answer ends with the template's end-of-turn token. Samples longer than ``max_length`` are
dropped, never truncated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import BituneError
from ..inputs import MIN_PROMPT_TOKENS, check_prompt_length
from .conversations import ChatExample, chat_token_ids, end_of_turn_id
from .templates import Example

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id written into padded positions (masked out, so its value never matters): the tokenizer's pad
    token, else its eos token.

    Raises:
        BituneError: the tokenizer has neither.
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise BituneError(f"tokenizer {tokenizer.name_or_path!r} has neither a pad nor an eos token")
    return pad


def pad_rows(rows: Sequence[Sequence[int]], pad: int, side: str, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token lists into (B, T) ids and mask (1 on real tokens), T the longest row.

    Args:
        rows: token ids per row (at least one row).
        pad: id written into padded positions.
        side: ``"left"`` (prompts: real tokens end every row) or ``"right"`` (answers: real tokens start it).
        device: where the tensors go (default cpu).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r} is not 'left' or 'right'")
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), T), dtype=torch.long)  # (B, T)
    for i, r in enumerate(rows):
        span = slice(T - len(r), T) if side == "left" else slice(0, len(r))
        ids[i, span] = torch.tensor(list(r), dtype=torch.long)
        mask[i, span] = 1
    return ids.to(device), mask.to(device)


def _eos_id(tokenizer: PreTrainedTokenizerBase) -> int:
    if tokenizer.eos_token_id is None:
        raise BituneError(f"tokenizer {tokenizer.name_or_path} has no eos token to end answers with")
    return tokenizer.eos_token_id


def _pack(prompt_ids: list[int], answer_ids: list[int], max_length: int,
          example: Example | ChatExample) -> dict | None:
    """The sample of ``example`` (``answer_ids`` already end with eos or end-of-turn), or None if too long."""
    if len(prompt_ids) < MIN_PROMPT_TOKENS:
        text = example.messages[:-1] if isinstance(example, ChatExample) else example.prompt
        check_prompt_length(len(prompt_ids), f"example {example.id}: prompt {text!r}")
    if len(prompt_ids) + len(answer_ids) > max_length:
        return None
    return {"prompt_ids": prompt_ids, "answer_ids": answer_ids}


def tokenize_example(tokenizer: PreTrainedTokenizerBase, example: Example | ChatExample,
                     max_length: int = 512) -> dict | None:
    """Tokenize one example into prompt and answer token ids.

    Args:
        tokenizer: The model's tokenizer.
        example: Prompt and answer text, or a conversation (its answer then ends with the end-of-turn token).
        max_length: Longest allowed prompt + answer (eos included), in tokens. Default 512.

    Returns:
        ``{"prompt_ids": [...], "answer_ids": [..., eos]}``, or None when the sample is longer
        than ``max_length`` (it is dropped, not truncated).

    Raises:
        BituneError: The prompt is shorter than 2 tokens, the tokenizer has no eos token, or (conversations) no
            chat template that renders it (see :mod:`bitune.data.conversations`).
    """
    if isinstance(example, ChatExample):
        return _pack(*chat_token_ids(tokenizer, example), max_length, example)
    prompt_ids = tokenizer(example.prompt, add_special_tokens=True)["input_ids"]
    answer_ids = tokenizer(example.answer, add_special_tokens=False)["input_ids"]
    return _pack(prompt_ids, [*answer_ids, _eos_id(tokenizer)], max_length, example)


def tokenize_dataset(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[Example | ChatExample], max_length: int = 512
) -> tuple[list[dict], int]:
    """Tokenize many examples at once (same result as :func:`tokenize_example` on each).

    Returns:
        ``(samples, n_dropped)``: the samples that fit in ``max_length``, in order, and how many did not.
    """
    if any(isinstance(e, ChatExample) for e in examples):
        eot = end_of_turn_id(tokenizer)
        packed = [_pack(*chat_token_ids(tokenizer, e, eot), max_length, e) if isinstance(e, ChatExample)
                  else tokenize_example(tokenizer, e, max_length) for e in examples]
        kept = [s for s in packed if s is not None]
        return kept, len(packed) - len(kept)
    eos = _eos_id(tokenizer)
    prompts = tokenizer([e.prompt for e in examples], add_special_tokens=True)["input_ids"] if examples else []
    answers = tokenizer([e.answer for e in examples], add_special_tokens=False)["input_ids"] if examples else []
    packed = [_pack(p, [*a, eos], max_length, e) for p, a, e in zip(prompts, answers, examples)]
    kept = [s for s in packed if s is not None]
    return kept, len(packed) - len(kept)


@dataclass
class Collator:
    """Pad a list of tokenized samples into the model's four batch tensors."""

    pad_token_id: int
    """Id written into padded positions (masked out; its value never matters)."""

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        """Batch samples from :func:`tokenize_example`.

        Returns:
            ``prompt_ids`` and ``prompt_mask`` (B, P), left-padded; ``answer_ids`` and
            ``answer_mask`` (B, A), right-padded; all LongTensors, masks 1 on real tokens.
        """
        if not samples:
            raise BituneError("cannot collate an empty batch")
        prompt_ids, prompt_mask = pad_rows([s["prompt_ids"] for s in samples], self.pad_token_id, "left")  # (B, P)
        answer_ids, answer_mask = pad_rows([s["answer_ids"] for s in samples], self.pad_token_id, "right")  # (B, A)
        return {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "answer_ids": answer_ids,
            "answer_mask": answer_mask,
        }
