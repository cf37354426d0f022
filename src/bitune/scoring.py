"""Scoring several answers to several prompts in one packed answer pass, without padding.

Multiple-choice evaluation scores continuations c_1..c_m of each prompt. Run as right-padded rows on copies of
the prompt cache, the answer pass computes m * max|c_i| positions per prompt and the prompt's last token x_P m
times. Packed, one sequence holds, prompt after prompt, x_P once and then every continuation without its last
token::

    [x_P | c_1[:-1] | ... | c_m[:-1]] [x'_P | c'_1[:-1] | ...] ...     sum over prompts of 1 + sum(|c_i| - 1)

on a one-row cache holding the prompts' caches one after another (:func:`bitune.cache.flatten_rows`). The mask
lets each continuation see its own prompt's cached keys, its x_P and its own earlier tokens only, at the
positions it would have alone. The logits are those of separate answer passes (up to float rounding: tests hold
it to :meth:`~bitune.model.BituneModel.answer_logits` and to lm-eval's ``hf`` model), and every computed
position is a real one. Attention is computed per packed prompt (:func:`packed_attention`: its positions against
its own cached keys and itself), not over the dense (S, R*T + S) mask; a caller still bounds S and R*T, which the
mask and the logits grow with (``BituneLM.ANSWER_TOKENS`` / ``ANSWER_KEYS``).

This module alone owns the packed pass's mask and its block attention function (its layout: the prompts'
spans; registration and switching are :mod:`bitune.attention`'s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import attention
from . import cache as kv
from .adapters import WeightSets
from .attention import block_attention, check_implementation, mask_format
from .masks import per_layer_type, position_ids
from .passes import Prefill

NAME = "bitune_packed"


@dataclass
class Packed:
    """Continuations of several prompts packed into one sequence of S positions.

    Attributes:
        ids: (S,) input ids: per prompt, x_P, then each continuation without its last token.
        row: (S,) which packed prompt (0..R-1) a position belongs to.
        branch: (S,) which continuation of its prompt (0 for x_P, i for c_i).
        offset: (S,) positions after x_P (0 for x_P, t for a continuation's t-th input token).
        targets: (N,) every continuation token to score, in input order.
        columns: (N,) where the logits predicting ``targets`` are.
        owner: (N,) which continuation (0..C-1, in input order) each target belongs to.
    """

    ids: torch.Tensor
    row: torch.Tensor
    branch: torch.Tensor
    offset: torch.Tensor
    targets: torch.Tensor
    columns: torch.Tensor
    owner: torch.Tensor


def pack(last_tokens: list[int], continuations: list[list[list[int]]], device=None) -> Packed:
    """Pack ``continuations[r]`` (non-empty token lists) behind ``last_tokens[r]``, prompt after prompt."""
    ids, row, branch, offset = [], [], [], []
    targets, columns, owner = [], [], []
    n = 0
    for r, (last, conts) in enumerate(zip(last_tokens, continuations, strict=True)):
        first = len(ids)
        ids.append(last)
        row.append(r)
        branch.append(0)
        offset.append(0)
        for i, cont in enumerate(conts, start=1):
            if not cont:
                raise ValueError("an empty continuation has nothing to score")
            columns += [first] + list(range(len(ids), len(ids) + len(cont) - 1))  # x_P predicts the first token
            ids += cont[:-1]
            row += [r] * (len(cont) - 1)
            branch += [i] * (len(cont) - 1)
            offset += range(1, len(cont))
            targets += cont
            owner += [n] * len(cont)
            n += 1
    return Packed(*(torch.tensor(x, dtype=torch.long, device=device)
                    for x in (ids, row, branch, offset, targets, columns, owner)))


def packed_mask(prompt_mask: torch.Tensor, packed: Packed, config, dtype: torch.dtype, attn_implementation: str,
                cached: dict[int | None, int]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The (1, 1, S, R*K + S) mask of a packed answer pass on R flattened prompt caches of K keys each.

    Args:
        prompt_mask: (R, T) mask of the cached prompt tokens (left padding), one row per packed prompt.
        cached: keys per row by sliding window (:func:`bitune.cache.keys_per_window`).
    """
    check_implementation(attn_implementation)
    R, T = prompt_mask.shape
    S = packed.ids.shape[0]
    same_row = packed.row[:, None] == packed.row[None, :]  # (S, S)
    same_branch = (packed.branch[None, :] == 0) | (packed.branch[None, :] == packed.branch[:, None])
    earlier = torch.ones(S, S, dtype=torch.bool, device=prompt_mask.device).tril()
    own = same_row & same_branch & earlier  # (S, S)
    start = prompt_mask.sum(1)  # (R,) x_P's position
    q_pos = start[packed.row] + packed.offset  # (S,)
    mine = packed.row[:, None] == torch.arange(R, device=prompt_mask.device)[None, :]  # (S, R)

    def build(window: int | None) -> torch.Tensor:
        K = cached[window]
        real = prompt_mask[:, T - K:].bool()  # (R, K)
        cache_ok = mine[:, :, None] & real[None]  # (S, R, K)
        packed_ok = own
        if window is not None:
            k_pos = position_ids(prompt_mask)[:, T - K:]  # (R, K)
            cache_ok = cache_ok & (q_pos[:, None, None] - k_pos[None] < window)
            packed_ok = own & (packed.offset[:, None] - packed.offset[None, :] < window)
        ok = torch.cat([cache_ok.reshape(S, R * K), packed_ok], dim=-1)[None, None]  # (1, 1, S, R*K + S)
        return mask_format(ok, attn_implementation, dtype)

    return per_layer_type(build, config)


def score_continuations(weights: WeightSets, text_config, prefill: Prefill,
                        continuations: list[list[list[int]]]) -> list[tuple[float, bool]]:
    """Sum of log-probabilities and is-greedy of every continuation, in one packed answer pass (the causal weights).

    Args:
        weights: the weight sets (``BituneModel.weights``).
        text_config: the model's text config.
        prefill: prompts read by :meth:`~bitune.model.BituneModel.prefill` (left untouched).
        continuations: per prefill row, the token lists to score after it (an empty list skips the row).

    Returns:
        ``(log p(c | prompt), c is the greedy continuation)`` per continuation, row by row, in input order.
    """
    if len(continuations) != prefill.mask.shape[0]:
        raise ValueError(f"{len(continuations)} lists of continuations for a prefill of {prefill.mask.shape[0]} rows")
    used = [r for r, conts in enumerate(continuations) if conts]
    if not used:
        return []
    device = prefill.mask.device
    rows = torch.tensor(used, device=device)
    packed = pack(prefill.last_token[rows, 0].tolist(), [continuations[r] for r in used], device)
    prompt_mask = prefill.mask[rows]  # (R, T)
    cache = kv.flatten_rows(prefill.cache, rows)
    base = weights.base
    attn = packed_mask(prompt_mask, packed, text_config, next(base.parameters()).dtype,
                       base.config._attn_implementation, kv.keys_per_window(prefill.cache))
    positions = prompt_mask.sum(1)[packed.row] + packed.offset  # (S,)
    bounds = torch.cumsum(torch.bincount(packed.row, minlength=len(used)), 0).tolist()  # each prompt's end
    with attention.running(base, NAME, list(zip([0] + bounds[:-1], bounds))):
        out = weights.call("causal", input_ids=packed.ids[None], attention_mask=attn,
                                 position_ids=positions[None], cache=cache, use_cache=True)
    # Normalised once per position (a prompt's last token predicts the first token of each of its continuations),
    # then only the N target entries read: no (N, V) copy of the logits. log_softmax rather than logsumexp: 2.6x
    # faster over a 49k vocabulary on a CPU thread (measured).
    logits = out.logits[0]  # (S, V)
    logp = torch.log_softmax(logits.float(), dim=-1)[packed.columns, packed.targets]  # (N,)
    misses = (logits.argmax(-1)[packed.columns] != packed.targets).float()  # (N,)
    count = int(packed.owner[-1]) + 1
    total = torch.zeros(count, device=device).index_add_(0, packed.owner, logp)
    missed = torch.zeros(count, device=device).index_add_(0, packed.owner, misses)
    return [(float(s), m == 0) for s, m in zip(total.tolist(), missed.tolist())]


# --------------------------------------------------------------------------------------------------- attention
@block_attention(NAME)
def packed_attention(module, query, key, value, attention_mask, spans: list[tuple[int, int]], inner, **kwargs):
    """Attention of a packed answer pass, prompt by prompt: query (1, h, S, d), key/value (1, h_kv, R*K + S, d),
    mask (1, 1, S, R*K + S), ``spans`` the (start, end) of each packed prompt; returns ((1, S, h, d), None).

    The dense mask lets the positions of packed prompt r see only prompt r's K cached keys and its own positions,
    so each prompt is computed alone, with the model's own attention implementation ``inner``: the dense result,
    at (S_r, K + S_r) scores per prompt instead of (S, R*K + S).
    """
    R, S = len(spans), query.shape[2]
    K = (key.shape[2] - S) // R  # keys per prompt in this layer (sliding-window layers keep fewer)
    outs = []
    for r, (a, b) in enumerate(spans):
        keys = torch.cat([key[:, :, r * K:(r + 1) * K], key[:, :, R * K + a:R * K + b]], dim=2)
        values = torch.cat([value[:, :, r * K:(r + 1) * K], value[:, :, R * K + a:R * K + b]], dim=2)
        mask = torch.cat([attention_mask[:, :, a:b, r * K:(r + 1) * K], attention_mask[:, :, a:b, R * K + a:R * K + b]],
                         dim=-1)
        out, _ = inner(module, query[:, :, a:b], keys, values, mask, **kwargs)  # (1, S_r, h, d)
        outs.append(out)
    return torch.cat(outs, dim=1), None


__all__ = ["Packed", "pack", "packed_mask", "score_continuations", "packed_attention"]
