"""Checks of what a :class:`~bitune.model.BituneModel` is given: the wrapped model, batches of left-padded
prompts and right-padded answers, and room for generated tokens. Each raises a ``ValueError`` that names the
problem."""

from __future__ import annotations

import torch
from torch import nn

from .errors import BituneError


def check_ids(model: nn.Module, *ids: torch.Tensor) -> None:
    """Token ids must be integers inside ``model``'s input embedding."""
    vocab = model.get_input_embeddings().num_embeddings
    for t in ids:
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"token ids must be integers, got {t.dtype}")
        if t.numel() and (t.min() < 0 or t.max() >= vocab):
            raise ValueError(f"token ids must be integers in [0, {vocab}) for this model; got ids in "
                             f"[{t.min().item()}, {t.max().item()}]")


MIN_PROMPT_TOKENS = 2
"""A prompt's fewest tokens: both prompt passes read all but the last token, which opens the answer."""


def check_prompt_length(prompt_tokens: int, what: str = "the prompt") -> None:
    """The rule on one prompt's length, for callers holding token ids (a tokenized prompt, a server request).

    Args:
        prompt_tokens: the prompt's number of tokens.
        what: names the prompt in the error. Default ``"the prompt"``.

    Raises:
        BituneError: fewer than :data:`MIN_PROMPT_TOKENS` tokens (names ``what`` and its length).
    """
    if prompt_tokens < MIN_PROMPT_TOKENS:
        raise BituneError(f"{what} has {prompt_tokens} token(s); at least {MIN_PROMPT_TOKENS} are needed (both "
                          "prompt passes read all but the last token, which opens the answer)")


def check_prompt(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """(B, P) left-padded prompts, each with at least :data:`MIN_PROMPT_TOKENS` real tokens."""
    if prompt_ids.dim() != 2 or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} "
                         "must both be (batch, prompt_len)")
    if prompt_ids.shape[0] == 0 or prompt_ids.shape[1] < MIN_PROMPT_TOKENS:
        raise ValueError(f"prompts must hold at least {MIN_PROMPT_TOKENS} tokens, got shape "
                         f"{tuple(prompt_ids.shape)}")
    if (prompt_mask.diff(dim=1) < 0).any() or not prompt_mask[:, -1].bool().all():
        raise ValueError("prompts must be left-padded: prompt_mask must be 0...0 1...1 in every row")
    short = prompt_mask.sum(1) < MIN_PROMPT_TOKENS  # (B,)
    if short.any():
        rows = short.nonzero().flatten().tolist()
        raise ValueError(f"prompt rows {rows} have fewer than {MIN_PROMPT_TOKENS} real tokens (the last one opens "
                         "the answer)")


def check_answer(prompt_ids: torch.Tensor, answer_ids: torch.Tensor, answer_mask: torch.Tensor) -> None:
    """(B, A) right-padded answers, one per prompt, each with at least 1 real token."""
    if answer_ids.dim() != 2 or answer_mask.shape != answer_ids.shape:
        raise ValueError(f"answer_ids {tuple(answer_ids.shape)} and answer_mask {tuple(answer_mask.shape)} "
                         "must both be (batch, answer_len)")
    if answer_ids.shape[0] != prompt_ids.shape[0]:
        raise ValueError(f"batch sizes differ: {prompt_ids.shape[0]} prompts, {answer_ids.shape[0]} answers")
    if answer_ids.shape[1] == 0 or not answer_mask[:, 0].bool().all():
        raise ValueError("every answer needs at least one real token (right-padded answer_mask)")
    if (answer_mask.diff(dim=1) > 0).any():
        raise ValueError("answers must be right-padded: answer_mask must be 1...1 0...0 in every row")


def max_positions(text_config) -> int | None:
    """The model's maximum position (prompt + answer): its config's ``max_position_embeddings``, or None if it
    names none."""
    limit = getattr(text_config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) else None


def context_room(text_config, prompt_tokens: int, requested: int, what: str = "the prompt") -> int:
    """New tokens that fit after ``prompt_tokens``: ``requested``, capped so that prompt + answer stay within the
    model's ``max_position_embeddings`` (uncapped when the config names no limit; :func:`positions_room`).

    Raises:
        BituneError: the prompt alone fills the model's positions (names ``what``, its length and the limit).
    """
    return positions_room(max_positions(text_config), prompt_tokens, requested, what)


def positions_room(limit: int | None, prompt_tokens: int, requested: int, what: str = "the prompt") -> int:
    """New tokens that fit after ``prompt_tokens`` within ``limit`` positions (prompt + answer): ``requested``,
    capped; uncapped when ``limit`` is None.

    Raises:
        BituneError: the prompt alone fills the ``limit`` positions (names ``what``, its length and the limit).
    """
    if limit is None:
        return requested
    if prompt_tokens >= limit:
        raise BituneError(f"{what} has {prompt_tokens} tokens, the model reads at most {limit} positions "
                          "(prompt + answer); shorten it")
    return min(requested, limit - prompt_tokens)
