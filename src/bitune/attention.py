"""Attention plumbing: the one place that talks to transformers' attention machinery.

The fused forward (:mod:`bitune.fused`) and the packed scoring pass (:mod:`bitune.scoring`) each compute attention
block by block over a layout of their own. What they share lives here: registering a block attention function with
transformers' ``AttentionInterface`` (:func:`block_attention`), handing it the layout of the forward that runs
(one ``ContextVar``), switching a model's attention implementation for one forward (:func:`attention_implementation`,
:func:`running`), the model's own attention function a block computes with (:func:`inner_attention`), and the mask
formats (:func:`check_implementation`, :func:`mask_format`: boolean for sdpa, additive for eager). ``fused`` and
``scoring`` supply only their layouts and block functions; :mod:`bitune.masks` builds the prompt passes' masks.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel

IMPLEMENTATIONS = ("eager", "sdpa")
"""The model attention implementations Bitune's 4D masks are built and tested for."""


# ------------------------------------------------------------------------------------------ a model's own masks
def open_own_masks(model: nn.Module) -> Callable[[], None]:
    """Open the causal masks a model's attention applies on its own, so that the masks the prompt passes hand it
    decide: GPT-Neo ANDs every attention with a registered boolean ``bias`` buffer (global layers: lower
    triangular; local layers: the last ``window_size`` positions). Global buffers become all True, local ones the
    symmetric band |i - j| < window_size; the model's own causal mask still makes its own forwards (the answer pass,
    decoding) causal. Returns the function that puts the original buffers back.

    Args:
        model: a transformers model (changed in place).
    """
    kept = []
    for module in model.modules():
        bias = getattr(module, "bias", None)
        kind = getattr(module, "attention_type", None)
        if kind not in ("global", "local") or not isinstance(bias, torch.Tensor) or bias.dtype != torch.bool:
            continue
        n = bias.shape[-1]
        i = torch.arange(n, device=bias.device)
        opened = torch.ones_like(bias) if kind == "global" else (
            (i[:, None] - i[None, :]).abs() < module.config.window_size).view(bias.shape)  # (1, 1, n, n)
        kept.append((module, bias))
        module.bias = opened

    undo = symmetric_alibi(model)

    def restore() -> None:
        for module, bias in kept:
            module.bias = bias
        undo()

    return restore


ALIBI_BUILDERS = ("build_alibi_tensor", "build_mpt_alibi_tensor")
"""The methods by which a model builds its ALiBi biases (Bloom, MPT), replaced by :func:`symmetric_alibi`."""


def symmetric_alibi(model: nn.Module) -> Callable[[], None]:
    """Make a model's ALiBi bias symmetric, ``-m_h |i - j|``, in forwards given a 4D mask (the prompt passes).

    Bloom and MPT add ``m_h x key position`` to every score, which equals ``-m_h (i - j)`` up to a constant per query
    row only where keys j <= i are read: a bidirectional pass would favour later tokens. In a forward given a 4D
    mask, the replaced builder returns the symmetric bias over that forward's queries (the last Q of its K keys),
    built per forward (no buffer at the model's maximum length); under a causal mask it is the model's own up to
    float rounding. Forwards given the 2D mask (the answer pass, decoding, the baselines) keep the model's bias. The
    slopes are the model's own (read from its builder). Index differences are position differences because the
    real tokens of a prompt pass's row are contiguous (left padding).

    Args:
        model: a transformers model (its modules changed in place).

    Returns:
        The function that puts the original builders back.
    """
    kept = []
    for module in model.modules():
        name = next((n for n in ALIBI_BUILDERS if n in type(module).__dict__), None)
        if name is None:
            continue
        own = getattr(module, name)
        shape: dict[str, tuple[int, int]] = {}  # the 4D mask's (Q, K) of the forward that runs

        def note(module, args, kwargs, shape=shape):
            mask = kwargs.get("attention_mask")
            shape.pop("qk", None)
            if isinstance(mask, torch.Tensor) and mask.dim() == 4:
                shape["qk"] = tuple(mask.shape[-2:])

        def build(*args, own=own, name=name, shape=shape, **kwargs):
            if "qk" not in shape:
                return own(*args, **kwargs)
            return _symmetric(own, name, shape["qk"], *args, **kwargs)

        hook = module.register_forward_pre_hook(note, with_kwargs=True)
        setattr(module, name, build)
        kept.append((module, name, hook))

    def restore() -> None:
        for module, name, hook in kept:
            hook.remove()
            delattr(module, name)  # the class's method again

    return restore


def _symmetric(own: Callable, name: str, qk: tuple[int, int], *args, **kwargs) -> torch.Tensor:
    """The symmetric ALiBi bias in the shape the model's own builder ``own`` returns (its slopes read from it)."""
    Q, K = qk
    if name == "build_alibi_tensor":  # Bloom: (attention_mask (B, K), heads, dtype) -> (B * heads, 1, K)
        mask, heads, dtype = args[0], args[1], args[2] if len(args) > 2 else kwargs["dtype"]
        slopes = own(torch.ones(1, 2, device=mask.device, dtype=torch.long), heads, torch.float32)[:, 0, 1]  # (H,)
        batch, device = mask.shape[0], mask.device
    else:  # MPT: (heads, max_seq_len, ...) -> (heads, 1, max_seq_len) = slopes x (1 - L .. 0)
        heads, device = args[0], kwargs.get("device", args[3] if len(args) > 3 else None)
        slopes = -own(heads, 2, *args[2:], **kwargs)[:, 0, 0].float()  # (H,)
        batch, dtype = None, torch.float32
    i = torch.arange(K - Q, K, device=device)[:, None]  # (Q, 1): the queries are the last Q keys
    j = torch.arange(K, device=device)[None, :]  # (1, K)
    bias = -slopes.to(device)[:, None, None] * (i - j).abs()  # (H, Q, K)
    if batch is None:
        return bias.to(dtype)  # MPT adds (H, Q, K) to (B, H, Q, K)
    return bias.repeat(batch, 1, 1).to(dtype)  # Bloom: (B * H, Q, K), the shape baddbmm takes


# --------------------------------------------------------------------------------------------------- mask formats
def check_implementation(name: str) -> None:
    """Refuse attention implementations other than eager and sdpa (the 4D masks are tested with those)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} is not supported (Bitune passes its own 4D masks, "
                         "tested with sdpa and eager); load the model with attn_implementation='sdpa' or 'eager'")


def mask_format(ok: torch.Tensor, attn_implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """A boolean 4D mask (True = attend) in the form ``attn_implementation`` takes: as it is for sdpa, additive
    for eager (0 where allowed, the dtype's minimum elsewhere, in the model's compute ``dtype``)."""
    if attn_implementation != "eager":
        return ok
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, torch.finfo(dtype).min)


# --------------------------------------------------------------------------------------------------- switching
_CONFIGS: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


@contextmanager
def attention_implementation(model: nn.Module, name: str) -> Iterator[None]:
    """Within this block, ``model`` computes attention with the registered implementation ``name``.

    What ``model.set_attn_implementation`` does for a text model (every transformers submodel's config says which
    attention function its layers call), without its walk over all modules and checks on every call (~15 ms on a
    30-layer model, twice per forward): the configs are found once per model. Restored on exit, error or not.
    """
    configs = _CONFIGS.get(model)
    if configs is None:
        found = {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}
        configs = _CONFIGS[model] = list(found.values())
    before = [c._attn_implementation_internal for c in configs]
    for c in configs:
        c._attn_implementation_internal = name
    try:
        yield
    finally:
        for c, impl in zip(configs, before):
            c._attn_implementation_internal = impl


def inner_attention(module: nn.Module, name: str) -> Callable:
    """The attention function ``name`` (``eager``: the module's own modeling file's) that a block computes with."""
    if name == "eager":  # each modeling file has its own eager function (soft-capping, sinks, ...)
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(module).__name__}: no eager attention function found; "
                             "use attn_implementation='sdpa'")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


# --------------------------------------------------------------------------------------------------- block attention
@dataclass(frozen=True)
class _Running:
    name: str
    layout: Any
    inner: str


_RUNNING: ContextVar[_Running | None] = ContextVar("bitune_block_attention", default=None)


def block_attention(name: str):
    """Register ``fn(module, query, key, value, attention_mask, layout, inner, **kwargs)`` as the attention
    implementation ``name``: within :func:`running` it gets that forward's ``layout`` and ``inner``, the model's
    own attention function (:func:`inner_attention`) to compute each block with."""
    def register(fn: Callable) -> Callable:
        def attention(module, query, key, value, attention_mask, **kwargs):
            run = _RUNNING.get()
            if run is None or run.name != name:
                raise RuntimeError(f"attention implementation {name!r} is only valid inside bitune's {name} forward")
            return fn(module, query, key, value, attention_mask, run.layout, inner_attention(module, run.inner),
                      **kwargs)

        AttentionInterface.register(name, attention)
        return fn
    return register


@contextmanager
def running(model: nn.Module, name: str, layout: Any) -> Iterator[None]:
    """Within this block ``model`` (a transformers model) computes attention with the block attention ``name``
    (:func:`block_attention`) over ``layout``; its own implementation computes each block."""
    token = _RUNNING.set(_Running(name, layout, model.config._attn_implementation))
    try:
        with attention_implementation(model, name):
            yield
    finally:
        _RUNNING.reset(token)


# --------------------------------------------------------------------------------------------------- grouped
GROUPED = "bitune_grouped"
"""The attention implementation of the slot cache's decoding step (:mod:`bitune.serve.slots`)."""


def grouped_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, scaling: float | None = None, dropout: float = 0.0,
                      softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of few queries over many cached keys, each key/value head read once by its group of query heads
    (grouped-query attention), with a boolean mask (True = attend).

    transformers' sdpa and eager functions repeat every key/value head for its query heads before attending
    when a mask is given (``repeat_kv``): a copy of the whole cache per layer and step, which for a slot cache
    (every slot's full length) costs more than the step's attention itself. Here the query heads of a group are
    stacked instead: (b, kv_heads, group * q, dim) against (b, kv_heads, length, dim).

    Args:
        query: (b, heads, q, dim).
        key, value: (b, kv_heads, length, dim).
        attention_mask: (b, 1, q, length) boolean.
        scaling: the scores' scale (default dim ** -0.5); softcap: Gemma 2-style logit soft-capping, if any.

    Returns:
        The output (b, q, heads, dim), as transformers' attention functions return it, and no weights.
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{GROUPED} attention does not implement attention sinks")
    b, heads, q, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    query = query * (scaling if scaling is not None else dim ** -0.5)  # scaled here: fewer entries than the scores
    scores = query.reshape(b, kv_heads, group * q, dim) @ key.transpose(-1, -2)  # (b, kv_heads, group*q, length)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, kv_heads, group, q, -1).masked_fill(~attention_mask[:, :, None], float("-inf"))
    probs = scores.float().softmax(-1).to(value.dtype).view(b, kv_heads, group * q, -1)
    out = (probs @ value).view(b, heads, q, dim)  # heads in the order repeat_kv gives them
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED, grouped_attention)


__all__ = ["ALIBI_BUILDERS", "symmetric_alibi", "GROUPED", "grouped_attention", "IMPLEMENTATIONS", "attention_implementation", "block_attention", "check_implementation",
           "inner_attention", "mask_format", "running"]
