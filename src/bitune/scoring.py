"""Scoring several answers to one prompt in one row of the answer pass.

Multiple-choice evaluation scores continuations c_1..c_m of each prompt. Run as m right-padded rows on copies of
the prompt cache, the answer pass computes m * max|c_i| positions, the prompt's last token x_P m times. Packed,
one row holds x_P once, then every continuation without its last token::

    [x_P | c_1[:-1] | c_2[:-1] | ... | c_m[:-1]]        1 + sum(|c_i| - 1) positions

and a mask lets each continuation see the prompt cache, x_P and its own earlier tokens only, at the positions it
would have alone (each continues from x_P's). The logits are those of the separate rows (up to float rounding:
tests hold it to the padded answer pass and to lm-eval's ``hf`` model); the positions computed are the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .masks import check_implementation, position_ids
from .passes import Prefill


@dataclass
class Packed:
    """Continuations packed into rows (``R`` rows of ``L`` positions).

    Attributes:
        ids: (R, L) input ids: x_P, then each continuation without its last token; padding repeats x_P.
        branch: (R, L) which continuation a position belongs to (0 for x_P, i for c_i, -1 for padding).
        offset: (R, L) positions after x_P (0 for x_P, t for a continuation's t-th input token).
        targets: (N,) every continuation token to score, continuation by continuation, row by row.
        rows, columns: (N,) where the logits predicting ``targets`` are.
        owner: (N,) which continuation (0..C-1, in input order) each target belongs to.
    """

    ids: torch.Tensor
    branch: torch.Tensor
    offset: torch.Tensor
    targets: torch.Tensor
    rows: torch.Tensor
    columns: torch.Tensor
    owner: torch.Tensor


def pack(last_tokens: list[int], continuations: list[list[list[int]]], device=None) -> Packed:
    """Pack ``continuations[r]`` (each a non-empty token list) of prompt row r behind its ``last_tokens[r]``."""
    rows = [[x] for x in last_tokens]
    branch = [[0] for _ in last_tokens]
    offset = [[0] for _ in last_tokens]
    targets, at_row, at_col, owner = [], [], [], []
    n = 0
    for r, conts in enumerate(continuations):
        for i, cont in enumerate(conts, start=1):
            if not cont:
                raise ValueError("an empty continuation has nothing to score")
            start = len(rows[r])
            rows[r] += cont[:-1]
            branch[r] += [i] * (len(cont) - 1)
            offset[r] += range(1, len(cont))
            targets += cont
            at_row += [r] * len(cont)
            at_col += [0] + list(range(start, start + len(cont) - 1))  # x_P predicts the first token
            owner += [n] * len(cont)
            n += 1
    L = max(len(r) for r in rows)

    def tensor(lists, fill):  # right-padded (R, L)
        return torch.tensor([x + [fill] * (L - len(x)) for x in lists], dtype=torch.long, device=device)

    return Packed(torch.tensor([r + [r[0]] * (L - len(r)) for r in rows], device=device), tensor(branch, -1),
                  tensor(offset, 0), *(torch.tensor(x, dtype=torch.long, device=device)
                                       for x in (targets, at_row, at_col, owner)))


def packed_mask(prefill: Prefill, packed: Packed, config, dtype: torch.dtype, attn_implementation: str,
                cached: dict[str | None, int]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The (R, 1, L, K + L) mask of a packed answer pass over ``prefill`` (K cached keys per layer type).

    Args:
        cached: keys in the cache per layer type (``None`` for models with one type); sliding-window layers
            keep only their last ``window - 1`` keys.
    """
    check_implementation(attn_implementation)
    real = packed.branch >= 0  # (R, L)
    L = real.shape[1]
    q_branch, k_branch = packed.branch[:, :, None], packed.branch[:, None, :]  # (R, L, 1), (R, 1, L)
    earlier = torch.ones(L, L, dtype=torch.bool, device=real.device).tril()  # key index <= query index
    own = ((k_branch == 0) | (k_branch == q_branch)) & earlier & real[:, None, :]  # (R, L, L)
    cache_positions = position_ids(prefill.mask)  # (R, T)
    start = prefill.mask.sum(1)  # (R,) x_P's position
    q_pos = start[:, None] + packed.offset  # (R, L)
    eye = torch.eye(L, dtype=torch.bool, device=real.device)

    def build(layer_type: str | None, window: int | None) -> torch.Tensor:
        K = cached[layer_type]
        cache_ok = prefill.mask[:, prefill.mask.shape[1] - K:].bool()[:, None, :].expand(-1, L, -1)  # (R, L, K)
        packed_ok = own
        if window is not None:
            cache_ok = cache_ok & (q_pos[:, :, None] - cache_positions[:, None, -K:] < window) if K else cache_ok
            packed_ok = own & (packed.offset[:, :, None] - packed.offset[:, None, :] < window)
        ok = torch.cat([cache_ok, packed_ok | eye], dim=-1)[:, None]  # (R, 1, L, K + L); padding sees itself
        if attn_implementation != "eager":
            return ok
        return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, torch.finfo(dtype).min)

    layer_types = list(getattr(config, "layer_types", None) or ())
    if "sliding_attention" in layer_types:
        return {"full_attention": build("full_attention", None),
                "sliding_attention": build("sliding_attention", config.sliding_window)}
    return build(None, getattr(config, "sliding_window", None) if not layer_types else None)


def cached_keys(cache, config) -> dict[str | None, int]:
    """Keys held per layer type by a filled cache (sliding-window layers may hold fewer)."""
    layer_types = list(getattr(config, "layer_types", None) or ())
    if "sliding_attention" not in layer_types:
        return {None: cache.layers[0].keys.shape[-2]}
    return {t: cache.layers[layer_types.index(t)].keys.shape[-2] for t in set(layer_types)}


def score_continuations(model, prefill: Prefill, continuations: list[list[list[int]]]) -> list[tuple[float, bool]]:
    """Sum of log-probabilities and is-greedy of every continuation, scored in one packed answer pass.

    Args:
        model: a :class:`~bitune.model.BituneModel`.
        prefill: R prompts read by :meth:`~bitune.model.BituneModel.prefill`; its cache is extended in place
            (pass a :meth:`Prefill.select` copy to keep it).
        continuations: per prompt row, the token lists to score after it.

    Returns:
        ``(log p(c | prompt), c is the greedy continuation)`` per continuation, row by row, in input order.
    """
    device = prefill.mask.device
    packed = pack(prefill.last_token[:, 0].tolist(), continuations, device)
    base = model.weights.base
    attn = packed_mask(prefill, packed, model.text_config, next(base.parameters()).dtype,
                       base.config._attn_implementation, cached_keys(prefill.cache, model.text_config))
    positions = (prefill.mask.sum(1, keepdim=True) + packed.offset) * (packed.branch >= 0)  # (R, L)
    out = model.weights.call("causal", input_ids=packed.ids, attention_mask=attn, position_ids=positions,
                             cache=prefill.cache, use_cache=True)
    logits = out.logits[packed.rows, packed.columns].float()  # (N, V)
    logp = F.log_softmax(logits, dim=-1).gather(-1, packed.targets[:, None])[:, 0]  # (N,)
    hit = (logits.argmax(-1) == packed.targets).float()  # (N,)
    count = int(packed.owner[-1]) + 1
    total = torch.zeros(count, device=device).index_add_(0, packed.owner, logp)
    misses = torch.zeros(count, device=device).index_add_(0, packed.owner, 1 - hit)
    return [(float(s), bool(m == 0)) for s, m in zip(total.tolist(), misses.tolist())]


__all__ = ["Packed", "pack", "packed_mask", "cached_keys", "score_continuations"]
