"""Decoding on a prefill: the answer's tokens one by one with the causal weights on the mixed cache.

:func:`decode` hands the prefill to transformers' ``generate`` (what :meth:`bitune.model.BituneModel.generate`
runs), optionally compiled from a static copy of the cache (:func:`decode_compile_config`); :func:`decode_step` is
one step of it, which the server batches continuously.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable

import torch
from torch import nn
from transformers import CompileConfig

from . import cache as kv
from .adapters import WeightSets
from .errors import BituneError
from .inputs import context_room
from .masks import position_ids
from .passes import Prefill


def decode_compile_config(device: torch.device) -> CompileConfig:
    """What transformers' ``generate`` compiles the decoding forward with: inductor's default mode on CPU (CUDA
    graphs, transformers' default mode, exist only on GPUs)."""
    if device.type == "cpu" and not (shutil.which("g++") or shutil.which("c++")):
        raise BituneError("compiled decoding on CPU needs a C++ compiler (torch.compile's inductor builds its "
                          "kernels with one): install g++, or decode without compile")
    config = CompileConfig(mode="default" if device.type == "cpu" else "reduce-overhead")
    config._compile_all_devices = True  # generate compiles on accelerators only unless this private flag is set
    return config


def generate_options(device: torch.device, compile: bool, return_state: bool, stop_strings: list[str] | None,
                     tokenizer, no_static: str | None) -> dict:
    """What :meth:`bitune.model.BituneModel.generate` adds to transformers' ``generate`` keyword arguments: the
    compile config with ``compile`` (:func:`decode_compile_config`), the stop strings with their tokenizer.

    Args:
        no_static: why the model cannot decode from a static cache (its layers' kinds), or None.

    Raises:
        ValueError: ``stop_strings`` without ``tokenizer``; ``compile`` with ``return_state``, or where ``no_static``.
        BituneError: ``compile`` on a CPU without a C++ compiler.
    """
    if stop_strings and tokenizer is None:
        raise ValueError("generate(stop_strings=...) needs tokenizer=")
    if compile and return_state:
        raise ValueError("generate(compile=True) decodes into a static cache and returns no conversation state; "
                         "drop return_state or compile")
    if compile and no_static is not None:
        raise ValueError(f"generate(compile=True) decodes from a static cache, which this model cannot use ({no_static})")
    options = {"compile_config": decode_compile_config(device)} if compile else {}
    return options | ({"stop_strings": stop_strings, "tokenizer": tokenizer} if stop_strings else {})


def room(text_config, prompt_mask: torch.Tensor, past: Prefill | None, requested: int) -> int:
    """New tokens that fit after the (B, P) prompts (with ``past``, after the conversation and its last token):
    ``requested``, capped so that no row passes the model's positions (:func:`bitune.inputs.context_room`).

    Raises:
        BituneError: the longest row fills the model's positions already.
    """
    held = past.mask.sum(1) + 1 if past is not None else 0  # (B,) a conversation's positions + its last token
    longest = int((prompt_mask.sum(1) + held).max())  # positions of the longest row before the answer
    return context_room(text_config, longest, requested, "the conversation" if past is not None else "the prompt")


def decode(base: nn.Module, text_config, pre: Prefill, max_new_tokens: int, do_sample: bool, compile: bool,
           **generate_kwargs) -> tuple[torch.Tensor, Prefill]:
    """Decode up to ``max_new_tokens`` tokens per row on ``pre`` with transformers' ``generate`` of ``base`` (the
    causal weights, merged or PEFT's active adapter): it feeds each row's pending token first, then its own.

    Args:
        base: the transformers model that decodes.
        text_config: its text config (the static cache's shapes).
        pre: the B rows read (:meth:`bitune.model.BituneModel.prefill`); ``pre.cache`` is extended in place unless
            ``compile``.
        max_new_tokens: the most tokens generated per row (already fitted to the model's positions).
        do_sample: sample instead of greedy decoding.
        compile: decode from a static copy of the cache, with ``generate_kwargs["compile_config"]`` set by the
            caller (:func:`decode_compile_config`).
        **generate_kwargs: passed on to ``generate``.

    Returns:
        (B, N) the generated tokens, and the conversation state after them (its cache is ``pre.cache``: without
            ``compile``, the one the answer extended).
    """
    input_ids = torch.cat([pre.ids, pre.last_token], dim=1)  # (B, T+1); all but the last are cached
    attention_mask = torch.cat([pre.mask, torch.ones_like(pre.last_token)], dim=1)  # (B, T+1)
    cache = pre.cache
    generate_kwargs.pop("use_cache", None)
    if compile:
        cache = kv.static_copy(cache, text_config, input_ids.shape[1] + max_new_tokens)
    # use_cache: decoding reads the given cache; a config that defaults it off (MPT) would make generate re-feed
    # every token after the first step on top of that cache
    out = base.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True,
                        max_new_tokens=max_new_tokens, do_sample=do_sample, **generate_kwargs)  # (B, T+1+N)
    new = out[:, input_ids.shape[1]:]  # (B, N)
    state = Prefill(pre.cache, out[:, :-1], torch.cat([attention_mask, torch.ones_like(new[:, :-1])], dim=1),
                    out[:, -1:])
    return new, state


@torch.no_grad()
def decode_step(weights: WeightSets, state: Prefill, pick: Callable[[torch.Tensor], torch.Tensor]) -> Prefill:
    """One decoding step on a prefill, as ``generate`` runs it after the prefill: the causal weights read each
    row's pending token (``state.last_token``) on top of the cache, and ``pick`` chooses the next one.

    A batch of rows can be stepped together whatever each row's length (left padding); rows can join
    (:meth:`Prefill.concat`) or leave (:meth:`Prefill.select`) between steps. ``state.cache`` is extended in place.

    Args:
        weights: the model's weight sets (the causal set decodes).
        state: the rows so far, B of them (from a prefill, or the previous step).
        pick: maps the (B, V) next-token logits to (B,) token ids (greedy: ``lambda logits: logits.argmax(-1)``).

    Returns:
        The state after the step: the pending tokens cached (``ids`` and ``mask`` one position longer,
            (B, T + 1)), the picked tokens pending as the (B, 1) ``last_token``.
    """
    mask = torch.cat([state.mask, torch.ones_like(state.last_token)], dim=1)  # (B, T+1)
    out = weights.call("causal", input_ids=state.last_token, attention_mask=mask,
                       position_ids=position_ids(mask)[:, -1:], cache=state.cache, use_cache=True, logits_to_keep=1)
    token = pick(out.logits[:, -1]).reshape(-1, 1).to(state.last_token)  # (B, 1)
    return Prefill(state.cache, torch.cat([state.ids, state.last_token], dim=1), mask, token)


__all__ = ["decode_compile_config", "generate_options", "room", "decode", "decode_step"]
