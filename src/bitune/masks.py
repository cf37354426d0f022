"""Attention masks of the prompt passes: the one place that makes a pass causal, bidirectional or anti-causal.

A prompt pass hands the model a prepared 4D mask (boolean for sdpa, additive for eager:
:func:`bitune.attention.mask_format`), which every
transformers 5.x architecture uses as-is (paper eq. 4 and 5). Models whose
config lists sliding-window layers get a per-layer-type dict, the form their forward accepts for hybrid masks.
Padding keys are always blocked; a padding query always sees itself, so no softmax row is empty (no NaN).
The fused forward builds its block mask from the same pieces (:func:`allowed`, :func:`per_layer_type`) in
:mod:`bitune.fused`.
"""

from __future__ import annotations

import torch

from .attention import check_implementation, mask_format
from .config import PASS_MASKS
from .kinds import Layers


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


def allowed(attention_mask: torch.Tensor, kind: str, window: int | None, chunk: int | None = None) -> torch.Tensor:
    """(B, 1, T, T) boolean: query row j may attend to key column i, for a pass of mask ``kind``.

    Args:
        attention_mask: (B, T) 1 for real tokens.
        kind: one of ``PASS_MASKS``.
        window: sliding-window size (keys further than this are blocked), or None.
        chunk: chunk size (a query reads the keys of its own chunk only, chunk = position // chunk, positions
            counting real tokens: :func:`position_ids`), or None.
    """
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
    if chunk is not None:
        block = position_ids(attention_mask) // chunk  # (B, T)
        keys = keys & (block[:, None, :, None] == block[:, None, None, :])  # (B, 1, T, T)
    eye = torch.eye(T, dtype=torch.bool, device=attention_mask.device)
    return (shape[None, None] & keys) | eye  # (B, 1, T, T)


def pass_mask(
    attention_mask: torch.Tensor, kind: str, dtype: torch.dtype, config, attn_implementation: str = "sdpa",
    past_mask: torch.Tensor | None = None, layers: Layers | None = None,
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
        layers: the model's layer kinds (:mod:`bitune.kinds`); a model with layers of several mask forms gets a
            per-layer-type dict (recurrent and conv layers: the (B, T) padding mask). None: attention layers only.

    Returns:
        (B, 1, T, T_past + T) mask, or ``{layer_type: mask}`` for models with sliding-window or recurrent layers.
    """
    check_implementation(attn_implementation)
    if layers is not None and layers.unknown is not None:  # a baseline on layers of unknown kinds: the model's masks
        if kind != "causal" or past_mask is not None:
            raise ValueError(f"a {kind} pass needs every layer's kind ({layers.unknown})")
        return attention_mask

    def build(window: int | None, chunk: int | None = None) -> torch.Tensor:
        if chunk is not None and past_mask is not None:
            raise ValueError("a prompt pass on top of a cache cannot count chunked layers' chunks")
        ok = allowed(attention_mask, kind, window, chunk)  # (B, 1, T, T)
        if past_mask is not None:
            past = past_mask.bool()[:, None, None, :].expand(-1, 1, ok.shape[2], -1)  # (B, 1, T, T_past)
            ok = torch.cat([past, ok], dim=-1)  # (B, 1, T, T_past + T)
        return mask_format(ok, attn_implementation, dtype)

    return per_layer_type(build, config, layers, attention_mask)


PLAIN = {"full_attention", "sliding_attention", "local_attention", "alibi_attention"}
"""Kinds of attention layers that read one 4D mask, or the per-type dict of sliding and full layers that every
model with sliding layers takes (GPT-Neo's local layers window themselves; ALiBi models have no layer types)."""


def per_layer_type(build, config, layers: Layers | None = None,
                   padding: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """``build(window)`` once, or once per layer type for models with sliding-window layers; for a model with
    layers of other kinds than :data:`PLAIN` (given its ``layers``), ``{layer type: its form}``
    (:attr:`bitune.kinds.LayerKind.mask`): ``build(window)``, a chunked layer's ``build(window, chunk=size)``, the
    padding form ``padding`` ((B, T) 1 for real tokens), ``"none"`` None."""
    if layers is not None and layers.types and not layers.names <= PLAIN:
        def form(mask: str, window: str | None = None, chunk: str | None = None):
            if mask != "attention":
                return padding if mask == "padding" else None
            size = getattr(config, window, None) if window else None
            return build(size, chunk=getattr(config, chunk)) if chunk else build(size)

        out = {t: form(k.mask, k.window, k.chunk) for t, k in layers.by_type.items()}
        for k in layers.kinds:
            out.update({key: form(mask) for key, mask in k.masks})
        return out
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
        return {key: None if masks[0][key] is None else torch.cat([m[key] for m in masks]) for key in masks[0]}
    return torch.cat(masks)
