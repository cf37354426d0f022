"""Attention masks of the prompt passes: the one place that makes a pass causal, bidirectional or anti-causal.

A prompt pass hands the model a prepared 4D mask (boolean for sdpa, additive for eager), which every
transformers 5.x architecture uses as-is (paper eq. 4 and 5). Models whose
config lists sliding-window layers get a per-layer-type dict, the form their forward accepts for hybrid masks.
Padding keys are always blocked; a padding query may see itself only, so no softmax row is empty (no NaN).
"""

from __future__ import annotations

import torch

from .config import PASS_MASKS


def position_ids(attention_mask: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
    """Positions that count real tokens only, so left padding does not shift them.

    Args:
        attention_mask: (B, T) 1 for real tokens.
        offset: (B,) positions already consumed (real tokens in the cache), or None.

    Returns:
        (B, T) LongTensor; padding positions get 0 (they are masked anyway).
    """
    pos = attention_mask.long().cumsum(-1) - 1  # (B, T)
    if offset is not None:
        pos = pos + offset[:, None]
    return pos.clamp(min=0) * attention_mask.long()


def _allowed(attention_mask: torch.Tensor, kind: str, window: int | None) -> torch.Tensor:
    """(B, 1, T, T) boolean: query row j may attend to key column i."""
    if kind not in PASS_MASKS:
        raise ValueError(f"unknown attention kind {kind!r}; allowed: {PASS_MASKS}")
    T = attention_mask.shape[-1]
    q = torch.arange(T, device=attention_mask.device)[:, None]  # (T, 1)
    k = torch.arange(T, device=attention_mask.device)[None, :]  # (1, T)
    if kind == "causal":
        shape = k <= q
        dist = q - k
    elif kind == "anti_causal":
        shape = k >= q
        dist = k - q
    else:
        shape = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device)
        dist = (q - k).abs()
    if window is not None:
        shape = shape & (dist < window)  # (T, T)
    keys = attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
    eye = torch.eye(T, dtype=torch.bool, device=attention_mask.device)
    return (shape[None, None] & keys) | eye  # (B, 1, T, T)


def pass_mask(
    attention_mask: torch.Tensor, kind: str, dtype: torch.dtype, config, attn_implementation: str = "sdpa",
    past_mask: torch.Tensor | None = None,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask to pass as ``attention_mask`` for one prompt pass.

    Args:
        attention_mask: (B, T) 1 for real tokens (left padding).
        kind: ``"causal"``, ``"bidirectional"`` or ``"anti_causal"``.
        dtype: the model's compute dtype (additive masks for eager attention must match it).
        config: the model's text config; its ``layer_types`` / ``sliding_window`` decide the form.
        attn_implementation: ``"eager"`` gets an additive float mask, ``"sdpa"`` a boolean one (True = attend).
        past_mask: (B, T_past) mask of tokens already in the cache, which every new token may see; None if the
            cache is empty.

    Returns:
        (B, 1, T, T_past + T) mask, or ``{layer_type: mask}`` for models with sliding-window layers.
    """
    _check_implementation(attn_implementation)

    def build(window: int | None) -> torch.Tensor:
        allowed = _allowed(attention_mask, kind, window)  # (B, 1, T, T)
        if past_mask is not None:
            past = past_mask.bool()[:, None, None, :].expand(-1, 1, allowed.shape[2], -1)  # (B, 1, T, T_past)
            allowed = torch.cat([past, allowed], dim=-1)  # (B, 1, T, T_past + T)
        if attn_implementation != "eager":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    return _per_layer_type(build, config)


def fused_mask(
    prompt_mask: torch.Tensor, step_mask: torch.Tensor, kinds: list[str], read: int, dtype: torch.dtype, config,
    attn_implementation: str = "sdpa",
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The mask of one forward over ``[prompt pass 1 | ... | prompt pass n | answer pass]`` (all passes at once).

    Query positions are the ``S = n * T + A`` input tokens; key positions are those ``S`` followed by any extra
    block the cache appends (:class:`bitune.cache.FusedCache` appends the T mixed prompt positions). Pass i sees
    its own T tokens with mask ``kinds[i]``; the answer pass sees the T prompt keys starting at key ``read``
    (its prompt cache: one pass's keys, or the mixed block) and its own tokens causally.

    Args:
        prompt_mask: (B, T) 1 for real prompt-pass tokens (left padding).
        step_mask: (B, A) 1 for real answer-pass tokens (right padding).
        kinds: the mask kind of each prompt pass, in sequence order.
        read: first key position of the T prompt keys the answer pass attends to.

    Returns:
        (B, 1, S, K) mask, K = max(S, read + T); or ``{layer_type: mask}`` for models with sliding windows.
    """
    _check_implementation(attn_implementation)
    B, T = prompt_mask.shape
    A = step_mask.shape[1]
    S = len(kinds) * T + A
    K = max(S, read + T)

    def build(window: int | None) -> torch.Tensor:
        allowed = torch.zeros(B, 1, S, K, dtype=torch.bool, device=prompt_mask.device)
        for i, kind in enumerate(kinds):
            allowed[:, :, i * T:(i + 1) * T, i * T:(i + 1) * T] = _allowed(prompt_mask, kind, window)
        answer = _allowed(torch.cat([prompt_mask, step_mask], dim=1), "causal", window)[:, :, T:]  # (B,1,A,T+A)
        allowed[:, :, S - A:, read:read + T] = answer[..., :T]
        allowed[:, :, S - A:, S - A:S] = answer[..., T:]
        if attn_implementation != "eager":
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    return _per_layer_type(build, config)


def _check_implementation(name: str) -> None:
    if name not in ("eager", "sdpa"):
        raise ValueError(f"attention implementation {name!r} is not supported (Bitune passes its own 4D masks, "
                         "tested with sdpa and eager); load the model with attn_implementation='sdpa' or 'eager'")


def _per_layer_type(build, config) -> torch.Tensor | dict[str, torch.Tensor]:
    """``build(window)`` once, or once per layer type for models with sliding-window layers."""
    layer_types = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" in layer_types:
        window = getattr(config, "sliding_window", None)
        return {"full_attention": build(None), "sliding_attention": build(window)}
    if not layer_types and getattr(config, "sliding_window", None):
        return build(config.sliding_window)  # single-type sliding models (Mistral)
    return build(None)


def concat_masks(masks: list) -> torch.Tensor | dict[str, torch.Tensor]:
    """Stack the masks of several row groups along the batch dimension (for one batched forward)."""
    if isinstance(masks[0], dict):
        return {key: torch.cat([m[key] for m in masks]) for key in masks[0]}
    return torch.cat(masks)
