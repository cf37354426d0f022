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
position is a real one. For attention the packed positions are laid out as one row per prompt over its own
cached keys (:func:`blocks`; rows of similar length grouped, each group padded to its own longest), so
:func:`packed_attention` computes each group in one batched call (eager models: their own attention function;
sdpa: :func:`bitune.attention.grouped_attention`, which reads each key/value head once), with an (R, 1, L, K + L)
mask (:func:`packed_mask`), never the dense (S, R*K + S) one; a caller still bounds S and R*K,
which the logits and the cache grow with (``BituneLM.ANSWER_TOKENS`` / ``ANSWER_KEYS``).

This module alone owns the packed pass's mask and its block attention function (its layout: :class:`Blocks`;
registration and switching are :mod:`bitune.attention`'s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import attention
from . import cache as kv
from .adapters import WeightSets
from .attention import block_attention, check_implementation, grouped_attention, mask_format
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


@dataclass
class Blocks:
    """The packed positions laid out as R right-padded rows, one per prompt, for batched attention.

    The rows are ordered by length (longest first, ``order``) and cut into groups of similar length, each padded
    only to its own longest (``groups``): answer lengths vary several-fold between questions, and one padding
    for all would compute mostly padding.

    Attributes:
        order: (R,) the packed prompt in each row (row i holds prompt ``order[i]``).
        index: (R, L) the packed position (0..S-1) at each row slot; padding slots repeat the row's last one.
        real: (R, L) True where a slot holds a packed position.
        groups: (first row, end row, slots L_g) of each group: its rows are ``first:end``, their first L_g slots.
        back: (S,) where each packed position is among the groups' real slots read in order (group by group, row
            by row).
    """

    order: torch.Tensor
    index: torch.Tensor
    real: torch.Tensor
    groups: list[tuple[int, int, int]]
    back: torch.Tensor


def blocks(packed: Packed, rows: int) -> Blocks:
    """Lay the packed positions of ``rows`` prompts (prompt r's positions are contiguous) out as rows, longest
    first, in groups whose rows are at least half as long as their longest."""
    lengths = torch.bincount(packed.row, minlength=rows)  # (R,)
    starts = torch.cumsum(lengths, 0) - lengths
    order = torch.argsort(lengths, descending=True, stable=True)
    lengths, starts = lengths[order], starts[order]
    slot = torch.arange(int(lengths[0]), device=packed.ids.device)  # (L,)
    real = slot[None, :] < lengths[:, None]  # (R, L)
    index = starts[:, None] + torch.minimum(slot[None, :], lengths[:, None] - 1)
    groups, first = [], 0
    sizes = lengths.tolist()
    for r in range(1, rows + 1):
        if r == rows or 2 * sizes[r] < sizes[first]:
            groups.append((first, r, sizes[first]))
            first = r
    read = torch.cat([index[a:b, :n][real[a:b, :n]] for a, b, n in groups])  # packed positions in reading order
    return Blocks(order, index, real, groups, torch.argsort(read))


def packed_mask(prompt_mask: torch.Tensor, packed: Packed, layout: Blocks, config, dtype: torch.dtype,
                attn_implementation: str, cached: dict[int | None, int]) -> torch.Tensor | dict[str, torch.Tensor]:
    """The (R, 1, L, K + L) mask of a packed answer pass in its block layout (:func:`blocks`): row i's slots
    against its prompt's K cached keys and row i's own slots.

    A continuation sees its prompt's real cached keys, x_P and its own earlier tokens, at the positions it would
    have alone (sliding-window layers: within the window). A padding slot sees x_P only (its output is dropped).

    Args:
        prompt_mask: (R, T) mask of the cached prompt tokens (left padding), one row per block row (in the
            layout's order).
        cached: keys per row by sliding window (:func:`bitune.cache.keys_per_window`).
    """
    check_implementation(attn_implementation)
    R, T = prompt_mask.shape
    index, real = layout.index, layout.real
    branch, offset = packed.branch[index], packed.offset[index]  # (R, L)
    L = index.shape[1]
    earlier = torch.ones(L, L, dtype=torch.bool, device=prompt_mask.device).tril()
    same_branch = (branch[:, None, :] == 0) | (branch[:, None, :] == branch[:, :, None])  # (R, L, L)
    own = same_branch & earlier & real[:, None, :] & real[:, :, None]
    own[:, :, 0] |= ~real  # a padding slot sees x_P: no row without a key
    q_pos = prompt_mask.sum(1)[:, None] + offset  # (R, L)

    def build(window: int | None) -> torch.Tensor:
        K = cached[window]
        cache_ok = (prompt_mask[:, None, T - K:].bool() & real[:, :, None])  # (R, L, K)
        own_ok = own
        if window is not None:
            k_pos = position_ids(prompt_mask)[:, T - K:]  # (R, K)
            cache_ok = cache_ok & (q_pos[:, :, None] - k_pos[:, None, :] < window)
            own_ok = own & (offset[:, :, None] - offset[:, None, :] < window)
        ok = torch.cat([cache_ok, own_ok], dim=-1)[:, None]  # (R, 1, L, K + L)
        return mask_format(ok, attn_implementation, dtype)

    return per_layer_type(build, config)


def _target_scores(logits: torch.Tensor, packed: Packed, chunk: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) log-probabilities of the targets and (N,) whether each is its position's argmax.

    Normalised once per position (a prompt's last token predicts the first token of each of its continuations),
    ``chunk`` positions at a time through one reused buffer: no (S, V) normalised copy, whose fresh pages cost
    more than the normalisation itself (log_softmax over 782 x 49k: 110-215 ms; this: 34 ms, 2 threads)."""
    S = logits.shape[0]
    lse = torch.empty(S, device=logits.device)
    best = torch.empty(S, dtype=torch.long, device=logits.device)
    buffer = torch.empty(min(chunk, S), logits.shape[1], device=logits.device)
    for i in range(0, S, chunk):
        part = logits[i:i + chunk].float()
        top = part.amax(-1, keepdim=True)
        shifted = torch.sub(part, top, out=buffer[:part.shape[0]])
        lse[i:i + chunk] = shifted.exp_().sum(-1).log_() + top[:, 0]
        best[i:i + chunk] = part.argmax(-1)
    logp = logits[packed.columns, packed.targets].float() - lse[packed.columns]
    return logp, best[packed.columns] == packed.targets


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
    layout = blocks(packed, len(used))
    prompt_mask = prefill.mask[rows]  # (R, T), in packed order
    cache = kv.flatten_rows(prefill.cache, rows[layout.order])  # in the layout's order
    base = weights.base
    attn = packed_mask(prompt_mask[layout.order], packed, layout, text_config, next(base.parameters()).dtype,
                       base.config._attn_implementation, kv.keys_per_window(prefill.cache))
    positions = prompt_mask.sum(1)[packed.row] + packed.offset  # (S,)
    with attention.running(base, NAME, layout):
        out = weights.call("causal", input_ids=packed.ids[None], attention_mask=attn,
                           position_ids=positions[None], cache=cache, use_cache=True)
    logp, greedy = _target_scores(out.logits[0], packed)  # (N,), (N,)
    count = int(packed.owner[-1]) + 1
    total = torch.zeros(count, device=device).index_add_(0, packed.owner, logp)
    missed = torch.zeros(count, device=device).index_add_(0, packed.owner, (~greedy).float())
    return [(float(s), m == 0) for s, m in zip(total.tolist(), missed.tolist())]


# --------------------------------------------------------------------------------------------------- attention
@block_attention(NAME)
def packed_attention(module, query, key, value, attention_mask, layout: Blocks, inner, **kwargs):
    """Attention of a packed answer pass, one batched call per group of prompts of similar length: query
    (1, h, S, d), key/value (1, h_kv, R*K + S, d) (the R flattened prompt caches in the layout's row order, then
    the packed positions), mask (R, 1, L, K + L) in the block layout ``layout`` (:func:`blocks`); returns
    ((1, S, h, d), None).

    A group's packed positions are gathered into rows of L_g slots, each row's keys are its prompt's K cached keys
    and its own slots, the model's own attention function ``inner`` (with sdpa's boolean mask
    :func:`~bitune.attention.grouped_attention`) computes the (rows, L_g, K + L_g) block,
    and the real slots are read back in packed order: (L_g, K + L_g) scores per prompt instead of (S, R*K + S).
    """
    R, S = layout.index.shape[0], query.shape[2]
    K = (key.shape[2] - S) // R  # keys per prompt in this layer (sliding-window layers keep fewer)
    if attention_mask.dtype == torch.bool:  # sdpa's boolean mask: each key/value head read once by its group
        inner = grouped_attention  # (sdpa with a mask repeats them per query head first: 3x the copies here)
    cached_k, cached_v = (x[0, :, :R * K].unflatten(1, (R, K)).transpose(0, 1) for x in (key, value))  # views
    new_k, new_v = key[0, :, R * K:], value[0, :, R * K:]  # (h_kv, S, d)
    outs = []
    for a, b, n in layout.groups:
        index = layout.index[a:b, :n]  # (G, n)
        q = query[0][:, index].transpose(0, 1)  # (G, h, n, d)
        k = torch.cat([cached_k[a:b], new_k[:, index].transpose(0, 1)], dim=2)  # (G, h_kv, K + n, d)
        v = torch.cat([cached_v[a:b], new_v[:, index].transpose(0, 1)], dim=2)
        out, _ = inner(module, q, k, v, attention_mask[a:b, :, :n, :K + n], **kwargs)  # (G, n, h, d)
        outs.append(out[layout.real[a:b, :n]])  # (real slots, h, d)
    return torch.cat(outs)[layout.back][None], None


__all__ = ["Blocks", "Packed", "blocks", "pack", "packed_mask", "score_continuations", "packed_attention"]
