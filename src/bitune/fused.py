"""The fused forward: prompt passes, mixing and answer pass as one forward of the model.

For prompts of T tokens (without their last) and answer passes of A tokens, the model reads
``[pass n | ... | pass 1 | answer]``: nT + A positions, positions restarting for each pass. Each segment runs
with its own weight set (per-position LoRA routing, :meth:`bitune.adapters.WeightSets.call_segments`) and its
own mask (:func:`fused_mask`); :class:`FusedCache` appends each layer's mixed prompt keys/values (eq. 6-7) for
the answer to read; :func:`fused_attention` computes only the attention blocks the mask allows. One forward of
2T + A tokens instead of three smaller ones: fewer, larger matrix products. The result is what
``answer_logits(prefill(...))`` computes (tests hold it to :mod:`bitune.reference`).

This module alone owns the fused path's mask, its ``DynamicCache`` subclass and its block attention function
(its layout; registration and switching are :mod:`bitune.attention`'s).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from . import attention
from .adapters import WeightSets
from .attention import block_attention, check_implementation, mask_format
from .masks import allowed, per_layer_type, position_ids
from .mixer import Mixer
from .recompute import recorded

NAME = "bitune_fused"


def fused_logits(weights: WeightSets, mixer: Mixer | None, passes: tuple[tuple[str, str], ...], text_config,
                 prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, answer_ids: torch.Tensor,
                 answer_mask: torch.Tensor) -> torch.Tensor:
    """Prompt passes, mixing and answer pass of a :class:`~bitune.model.BituneModel` in one forward.

    Args:
        weights: the weight sets (``BituneModel.weights``), routable per position for every pass's set.
        mixer: the mixer (None for one prompt pass: the answer then reads that pass's keys).
        passes: ``(weight set, mask kind)`` per prompt pass, causal first (``BituneConfig.passes``).
        text_config: the model's text config.
        prompt_ids, prompt_mask: (B, P) left-padded prompts, at least 2 real tokens each.
        answer_ids, answer_mask: (B, A) right-padded answers.

    Returns:
        (B, A, V) answer logits. The price of one forward: the last layer's q/o/MLP also run on prompt
        positions, which the separate prompt passes skip.
    """
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # (B, T)
    step_ids = torch.cat([prompt_ids[:, -1:], answer_ids[:, :-1]], dim=1)  # (B, A)
    step_mask = torch.cat([torch.ones_like(prompt_mask[:, -1:]), answer_mask[:, :-1]], dim=1)  # (B, A)
    T, A = ids.shape[1], step_ids.shape[1]
    passes = passes[::-1]  # the bidirectional pass first, so the causal one runs on into the answer
    S = len(passes) * T + A
    read = S if mixer is not None else 0  # the mixed block the cache appends, or the one pass's keys
    base = weights.base
    dtype = next(base.parameters()).dtype
    attn = fused_mask(mask, step_mask, [k for _, k in passes], read, dtype, text_config,
                      base.config._attn_implementation)
    positions = position_ids(mask)  # (B, T)
    answer_positions = position_ids(torch.cat([mask, step_mask], dim=1))[:, T:]  # (B, A)
    with recorded(attention.running, base, NAME, FusedLayout(T, len(passes), read)):
        out = weights.call_segments(
            [(w, T) for w, _ in passes] + [("causal", A)],
            input_ids=torch.cat([ids] * len(passes) + [step_ids], dim=1),  # (B, S)
            attention_mask=attn, position_ids=torch.cat([positions] * len(passes) + [answer_positions], dim=1),
            cache=FusedCache(text_config, T, mixer), use_cache=True, logits_to_keep=A)
    return out.logits  # (B, A, V)


# --------------------------------------------------------------------------------------------------- mask
def fused_mask(
    prompt_mask: torch.Tensor, step_mask: torch.Tensor, kinds: list[str], read: int, dtype: torch.dtype, config,
    attn_implementation: str = "sdpa",
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask of one forward over ``[prompt pass 1 | ... | prompt pass n | answer pass]`` (all passes at once).

    Query positions are the ``S = n * T + A`` input tokens; key positions are those ``S`` followed by any extra
    block the cache appends (:class:`FusedCache` appends the T mixed prompt positions). Pass i sees its own T
    tokens with mask ``kinds[i]``; the answer pass sees the T prompt keys starting at key ``read`` (its prompt
    cache: one pass's keys, or the mixed block) and its own tokens causally.

    Args:
        prompt_mask: (B, T) 1 for real prompt-pass tokens (left padding).
        step_mask: (B, A) 1 for real answer-pass tokens (right padding).
        kinds: the mask kind of each prompt pass, in sequence order.
        read: first key position of the T prompt keys the answer pass attends to.

    Returns:
        (B, 1, S, K) mask, K = max(S, read + T); or ``{layer_type: mask}`` for models with sliding windows.
    """
    check_implementation(attn_implementation)
    B, T = prompt_mask.shape
    A = step_mask.shape[1]
    S = len(kinds) * T + A
    K = max(S, read + T)

    def build(window: int | None) -> torch.Tensor:
        ok = torch.zeros(B, 1, S, K, dtype=torch.bool, device=prompt_mask.device)
        for i, kind in enumerate(kinds):
            ok[:, :, i * T:(i + 1) * T, i * T:(i + 1) * T] = allowed(prompt_mask, kind, window)
        answer = allowed(torch.cat([prompt_mask, step_mask], dim=1), "causal", window)[:, :, T:]  # (B, 1, A, T+A)
        ok[:, :, S - A:, read:read + T] = answer[..., :T]
        ok[:, :, S - A:, S - A:S] = answer[..., T:]
        return mask_format(ok, attn_implementation, dtype)

    return per_layer_type(build, config)


# --------------------------------------------------------------------------------------------------- cache
class FusedCache(DynamicCache):
    """Stands in for the cache of the fused forward.

    It stores nothing: each layer's keys and values come back extended by the T mixed prompt positions
    ``mix(layer, K_causal, K_bidir, V_causal, V_bidir)``, which the mask lets the answer tokens (only) attend to. Gradients flow
    through the mixing into both passes, as in the sequential path.

    Args:
        config: the model's text config.
        prompt_len: T, tokens per prompt pass.
        mix: the mixer (None for one prompt pass: the answer then reads that pass's keys directly).
    """

    writes_nothing = True
    """Its ``update`` only computes (a recomputation may call it again: :class:`bitune.cache.Replay`)."""

    def __init__(self, config, prompt_len: int, mix=None):
        super().__init__(config=config)
        self.prompt_len = prompt_len
        self.mix = mix

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.mix is None:
            return key_states, value_states
        T = self.prompt_len  # positions: [0, T) the bidirectional pass, [T, 2T) the causal pass, then the answer
        k, v = self.mix(layer_idx, key_states[..., T:2 * T, :], key_states[..., :T, :],
                        value_states[..., T:2 * T, :], value_states[..., :T, :])
        return torch.cat([key_states, k], dim=-2), torch.cat([value_states, v], dim=-2)


# --------------------------------------------------------------------------------------------------- attention
@dataclass(frozen=True)
class FusedLayout:
    """Where things are in the fused sequence.

    Attributes:
        prompt_len: T, positions per prompt pass.
        passes: n, prompt passes at positions [0, nT).
        read: first key position of the T prompt keys the answer reads (a pass's own, or the mixed block).
    """

    prompt_len: int
    passes: int
    read: int


@block_attention(NAME)
def fused_attention(module, query, key, value, attention_mask, layout: FusedLayout, inner, **kwargs):
    """Attention for query (B, h, S, d), key/value (B, h_kv, K, d), mask (B, 1, S, K); returns ((B, S, h, d), None).

    Dense attention over the fused mask would cost (nT + A) x (nT + A + T) scores per head; this computes only
    the blocks that can be non-zero: the n prompt passes stacked as n*B rows of T x T, and the answer's
    A x (T + A), each with the model's own attention implementation ``inner`` (sdpa or its eager function), so
    the result is what the dense computation would give.
    """
    B, T, n = query.shape[0], layout.prompt_len, layout.passes
    P, S = n * T, query.shape[2]

    def passes(x: torch.Tensor) -> torch.Tensor:  # (B, ., S or K, d) -> (n*B, ., T, d): one row block per pass
        return torch.cat([x[:, :, i * T:(i + 1) * T] for i in range(n)])

    pass_mask = torch.cat([attention_mask[:, :, i * T:(i + 1) * T, i * T:(i + 1) * T] for i in range(n)])
    out_passes, _ = inner(module, passes(query), passes(key), passes(value), pass_mask, **kwargs)  # (nB, T, h, d)

    def answer_keys(x: torch.Tensor) -> torch.Tensor:  # (B, ., T + A, d): the prompt keys it reads, then its own
        return torch.cat([x[:, :, layout.read:layout.read + T], x[:, :, P:S]], dim=2)

    answer_mask = torch.cat([attention_mask[:, :, P:, layout.read:layout.read + T], attention_mask[:, :, P:, P:S]],
                            dim=-1)  # (B, 1, A, T + A)
    out_answer, _ = inner(module, query[:, :, P:], answer_keys(key), answer_keys(value), answer_mask, **kwargs)
    return torch.cat([*out_passes.split(B), out_answer], dim=1), None  # (B, S, h, d)


__all__ = ["fused_logits", "fused_mask", "FusedCache", "FusedLayout", "fused_attention"]
