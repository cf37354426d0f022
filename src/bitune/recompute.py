"""Recompute: activation checkpointing per decoder layer that keeps the prompt passes' caches (the ``recompute``
training setting).

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

from .errors import BituneError

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


def decoder_layers(models: list[nn.Module], num_layers: int) -> list[nn.Module]:
    """Every decoder layer of ``models`` (in order), found by the class names transformers lists in
    ``_no_split_modules``: the units recompute and FSDP work on.

    Raises:
        BituneError: a model names no decoder layer class, or does not hold ``num_layers`` of them.
    """
    found = []
    for model in models:
        names = set(getattr(model, "_no_split_modules", None) or ())
        layers = [m for m in model.modules() if type(m).__name__ in names]
        if not layers or len(layers) != num_layers:
            raise BituneError(f"{type(model).__name__}: no list of {num_layers} decoder layers found "
                              f"(_no_split_modules={sorted(names)}); activation checkpointing and FSDP "
                              "need one module per decoder layer")
        found += layers
    return found


def refuse_transformers_checkpointing(models: list[nn.Module], training: bool) -> None:
    """Refuse transformers' own gradient checkpointing on any of ``models`` in training: it drops the prompt
    caches the answer reads (it sets ``use_cache=False``). :func:`checkpoint_layers` is the one that keeps them."""
    if training and any(getattr(m, "is_activation_checkpointing", False) for m in models):
        raise ValueError("transformers' gradient checkpointing (gradient_checkpointing_enable) drops the prompt "
                         "cache in training; turn it off and use BituneModel.enable_recompute() "
                         "(the 'recompute: true' setting of bitune train)")


def recomputing(layers: list[nn.Module]) -> bool:
    """Whether :func:`checkpoint_layers` made ``layers`` recompute."""
    return any("forward" in layer.__dict__ for layer in layers)


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
        runs = [0]

        def run(*a, **kw):
            for replay in replays.values():  # a second run is the recomputation: it must write nothing
                replay.replaying = runs[0] > 0
            runs[0] += 1
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


__all__ = ["recorded", "decoder_layers", "refuse_transformers_checkpointing", "recomputing", "checkpoint_layers"]
