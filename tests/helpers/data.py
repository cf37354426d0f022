"""Token-id training samples of mixed prompt and answer lengths, as ``tokenize_dataset`` returns them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from helpers.models import EOS, VOCAB


def train_lengths(i: int) -> tuple[int, int]:
    """Prompts of 3-6 ids, answers of 2-4 (before the end token): the single-process training tests."""
    return 3 + i % 4, 2 + i % 3


def rank_lengths(i: int) -> tuple[int, int]:
    """Prompts of 3-7 ids, answers of 1-7 (before the end token): the ranks of a multi-process job hold different
    token counts."""
    return 3 + i % 5, 1 + (3 * i) % 7


def varied_lengths(i: int) -> tuple[int, int]:
    """Prompts of 2-14 ids, answers of 1-6 (before the end token): a spread for length-grouped batches."""
    return 2 + (7 * i) % 13, 1 + (5 * i) % 6


def samples(n: int = 8, seed: int = 0, lengths: Callable[[int], tuple[int, int]] = train_lengths) -> list[dict]:
    """``n`` samples; sample ``i`` has a prompt and an answer (then the end token) of ``lengths(i)`` random ids."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, a = lengths(i)
        out.append({"prompt_ids": torch.randint(3, VOCAB, (p,), generator=g).tolist(),
                    "answer_ids": torch.randint(3, VOCAB, (a,), generator=g).tolist() + [EOS]})
    return out
