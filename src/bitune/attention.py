"""Attention of the fused forward: the one place that touches transformers' attention dispatch.

The fused forward (:meth:`bitune.model.BituneModel.fused_logits`) reads ``[pass 1 | ... | pass n | answer]`` as
one sequence, and :class:`bitune.cache.FusedCache` appends the mixed prompt keys/values. Its mask
(:func:`bitune.masks.fused_mask`) is block-sparse: each prompt pass sees only its own T positions, the answer
only the prompt keys it reads and itself. Dense attention over that mask would cost (nT + A) x (nT + A + T)
scores per head; this module computes only the blocks that can be non-zero: the n prompt passes stacked as
n*B rows of T x T, and the answer's A x (T + A), each with the model's own attention implementation (sdpa or
its eager function), so the result is what the dense computation would give.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

NAME = "bitune_fused"


@dataclass(frozen=True)
class FusedLayout:
    """Where things are in the fused sequence.

    Attributes:
        prompt_len: T, positions per prompt pass.
        passes: n, prompt passes at positions [0, nT).
        read: first key position of the T prompt keys the answer reads (a pass's own, or the mixed block).
        inner: the model's own attention implementation, which computes each block.
    """

    prompt_len: int
    passes: int
    read: int
    inner: str


_LAYOUT: ContextVar[FusedLayout | None] = ContextVar("bitune_fused_layout", default=None)


def _inner_function(module: nn.Module, name: str):
    if name == "eager":  # each modeling file has its own eager function (soft-capping, sinks, ...)
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(module).__name__}: no eager attention function found; "
                             "use attn_implementation='sdpa'")
        return eager
    return ALL_ATTENTION_FUNCTIONS[name]


def fused_attention(module, query, key, value, attention_mask, **kwargs):
    """Attention for query (B, h, S, d), key/value (B, h_kv, K, d), mask (B, 1, S, K); returns ((B, S, h, d), None)."""
    layout = _LAYOUT.get()
    if layout is None:
        raise RuntimeError(f"attention implementation {NAME!r} is only valid inside bitune's fused forward")
    inner = _inner_function(module, layout.inner)
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


AttentionInterface.register(NAME, fused_attention)


@contextmanager
def fused(model: nn.Module, prompt_len: int, passes: int, read: int):
    """Within this block, ``model`` (a transformers model) computes attention with :func:`fused_attention`."""
    impl = model.config._attn_implementation
    token = _LAYOUT.set(FusedLayout(prompt_len, passes, read, impl))
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(impl)
        _LAYOUT.reset(token)
