"""Activation checkpointing per decoder layer that keeps the prompt passes' caches (``gradient_checkpointing``).

transformers' own ``gradient_checkpointing_enable`` turns the cache off in training (a prompt pass would lose the
keys and values the answer reads). Here each decoder layer's ``forward`` is run under
``torch.utils.checkpoint`` (non-reentrant) instead, and the two things a recomputation in the backward pass could
get wrong are handled:

- **the cache**: a layer writes its keys/values into the cache it is given. The recomputation gets a stand-in
  (:class:`bitune.cache.Replay`) that returns what the first call's update returned and writes nothing, so the
  cache is never appended to twice;
- **how the forward was set up**: routing LoRA adapters per row or position, a switched PEFT adapter, the fused
  attention. These are entered with :func:`recorded`; a checkpointed layer remembers the ones active when it ran
  and re-enters them around its recomputation.

So a checkpointed forward computes the same loss and gradients as one without checkpointing
(tests/test_recompute.py), on every path (fused, batched, sequential), under DDP and FSDP.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_ACTIVE: ContextVar[tuple] = ContextVar("bitune_forward_setup", default=())


@contextmanager
def recorded(factory: Callable[..., Any], *args: Any) -> Iterator[None]:
    """Enter the context manager ``factory(*args)`` and record it, so a checkpointed layer can re-enter it."""
    token = _ACTIVE.set(_ACTIVE.get() + ((factory, args),))
    try:
        with factory(*args):
            yield
    finally:
        _ACTIVE.reset(token)


@contextmanager
def _reentered(setup: tuple) -> Iterator[None]:
    with ExitStack() as stack:
        for factory, args in setup:
            stack.enter_context(factory(*args))
        yield


def checkpoint_layers(layers: list[nn.Module]) -> None:
    """Make every module of ``layers`` (decoder layers) run under activation checkpointing in training.

    The module itself is untouched (same parameters and names; its ``forward`` is overridden on the instance),
    so FSDP's hooks, state dicts and checkpoints see the model as before. Idempotent.
    """

    for layer in layers:
        if "forward" not in layer.__dict__:
            layer.forward = _checkpointed(type(layer).forward.__get__(layer))


def _checkpointed(inner: Callable[..., Any]) -> Callable[..., Any]:
    """``inner`` (a layer's own forward) run under ``torch.utils.checkpoint`` when autograd records."""
    from . import cache as kv

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        setup = _ACTIVE.get()  # what the recomputation must re-enter
        replays = {k: kv.Replay(v) for k, v in kwargs.items() if kv.is_cache(v)}

        def run(*a, **kw):
            try:
                return inner(*a, **{**kw, **replays})
            except kv.PassComplete:  # a prompt pass ends in this layer: a normal end for the checkpoint
                return None

        out = checkpoint(run, *args, use_reentrant=False, context_fn=lambda: (_nothing(), _reentered(setup)),
                         **kwargs)
        if out is None:
            raise kv.PassComplete
        return out

    return forward


@contextmanager
def _nothing() -> Iterator[None]:
    yield


__all__ = ["recorded", "checkpoint_layers"]
