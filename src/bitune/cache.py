"""Reading and building KV caches: the one place that touches transformers' Cache internals.

A prompt pass fills a :class:`PromptCache`, which ends the forward as soon as the last layer has written its
keys and values: only K/V reach the answer, so the last layer's attention output, MLP, final norm and lm_head
would be wasted work. Two prompt caches are mixed layer by layer into the first one (paper eq. 6-7). The fused
forward's stand-in cache, which stores nothing, lives with that path (:class:`bitune.fused.FusedCache`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, StaticCache


class PassComplete(Exception):
    """Raised inside a prompt pass once every layer's keys and values are in the cache."""


class PromptCache(DynamicCache):
    """A DynamicCache that can stop the forward right after the last layer's K/V update.

    Args:
        config: the model's text config (decides full vs sliding-window layers).
        stop_after_layer: layer index after whose update the forward is cut short; None never stops.
    """

    def __init__(self, config, stop_after_layer: int | None = None):
        super().__init__(config=config)
        self.stop_after_layer = stop_after_layer

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.stop_after_layer:
            raise PassComplete
        return out


def is_cache(value) -> bool:
    """Whether ``value`` is a transformers cache (what a decoder layer writes its keys and values into)."""
    return isinstance(value, Cache)


class Replay:
    """Stands in for ``cache`` in one checkpointed decoder-layer call (:mod:`bitune.recompute`).

    The first ``update`` is the real one: it writes into ``cache`` and remembers what the layer held before. A
    later ``update`` of the same layer is the recomputation in the backward pass: it returns what the first one
    returned (the keys/values held before, then the recomputed new ones; for a cache whose ``update`` writes
    nothing, such as the fused forward's, its own result again) and writes nothing, so nothing is appended
    twice. A prompt pass that stopped after this layer's update (:class:`PassComplete`) stops again.
    """

    def __init__(self, cache):
        self._cache = cache
        self._first: dict[int, tuple] = {}

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx not in self._first:
            layer = self._cache.layers[layer_idx] if layer_idx < len(self._cache.layers) else None
            keys = getattr(layer, "keys", None)
            before = (keys, layer.values) if keys is not None and keys.numel() else None
            try:
                out = self._cache.update(key_states, value_states, layer_idx, *args, **kwargs)
            except PassComplete:
                self._first[layer_idx] = (before, True)
                raise
            self._first[layer_idx] = (before, False)
            return out
        before, stopped = self._first[layer_idx]
        if getattr(self._cache, "writes_nothing", False):
            out = self._cache.update(key_states, value_states, layer_idx, *args, **kwargs)
        elif before is not None:
            out = torch.cat([before[0], key_states], dim=-2), torch.cat([before[1], value_states], dim=-2)
        else:
            out = key_states, value_states
        if stopped:
            raise PassComplete
        return out


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer, each (B, n_kv_heads, T, head_dim)."""
    return cache.layers[layer].keys, cache.layers[layer].values


def num_layers(cache) -> int:
    return len(cache.layers)


def mix_into(cache_causal, cache_bidir, mix, start: int = 0) -> None:
    """Replace every layer's K/V of ``cache_causal`` by ``mix(layer, K_causal, K_bidir, V_causal, V_bidir)``; other
    state is kept.

    Args:
        start: positions before ``start`` (a shared history both caches extended) are kept as they are.
    """
    if num_layers(cache_causal) != num_layers(cache_bidir):
        raise ValueError("prompt caches have different numbers of layers")
    for i, (lc, lb) in enumerate(zip(cache_causal.layers, cache_bidir.layers)):
        k, v = mix(i, lc.keys[..., start:, :], lb.keys[..., start:, :], lc.values[..., start:, :],
                   lb.values[..., start:, :])
        lc.keys = torch.cat([lc.keys[..., :start, :], k], dim=-2) if start else k
        lc.values = torch.cat([lc.values[..., :start, :], v], dim=-2) if start else v


def split_rows(cache, sizes: list[int]) -> list:
    """Split a cache along the batch dimension into independent caches (after one batched forward)."""
    parts = []
    start = 0
    for size in sizes:
        part = copy.copy(cache)
        part.layers = [copy.copy(layer) for layer in cache.layers]
        for layer in part.layers:
            layer.keys = layer.keys[start:start + size]
            layer.values = layer.values[start:start + size]
        parts.append(part)
        start += size
    return parts


def select_rows(cache, index: torch.Tensor):
    """A new cache whose row r is row ``index[r]`` of ``cache``; the original is left untouched.

    Args:
        cache: a filled cache with batch size B.
        index: (B',) LongTensor of rows to take (repeats allowed).
    """
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in out.layers:
        layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
        layer.values = layer.values.index_select(0, index.to(layer.values.device))
    return out


def keys_per_window(cache) -> dict[int | None, int]:
    """Keys per row held by a filled cache's layers, by their sliding window (None: full attention); a
    sliding-window layer keeps only its last ``window - 1``."""
    return {(layer.sliding_window if getattr(layer, "is_sliding", False) else None): layer.keys.shape[-2]
            for layer in cache.layers}


def flatten_rows(cache, rows: torch.Tensor):
    """A new one-row cache holding rows ``rows`` of ``cache`` one after another along the sequence: layer keys
    (B, h, T, d) become (1, h, len(rows) * T, d). For a packed answer pass whose mask keeps each row's tokens
    on its own keys (:mod:`bitune.scoring`); the original is left untouched."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in out.layers:
        for name in ("keys", "values"):
            x = getattr(layer, name).transpose(0, 1).index_select(1, rows.to(layer.keys.device))  # (h, R, T, d)
            setattr(layer, name, x.reshape(1, x.shape[0], -1, x.shape[3]))  # (1, h, R*T, d): a view, one copy in all
    return out


def concat_rows(caches: list):
    """One cache holding the rows of ``caches`` one after another (batch dimension); each layer's keys/values are
    left-padded with zeros to the longest among them (for left-padded prompts whose masks are padded alike)."""
    out = copy.copy(caches[0])
    out.layers = [copy.copy(layer) for layer in caches[0].layers]
    for i, layer in enumerate(out.layers):
        for name in ("keys", "values"):
            parts = [getattr(c.layers[i], name) for c in caches]  # (B_j, h, T_j, d)
            T = max(x.shape[2] for x in parts)
            setattr(layer, name, torch.cat([torch.nn.functional.pad(x, (0, 0, T - x.shape[2], 0)) for x in parts]))
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer: positions seen by the longest row
            layer.cumulative_length = max(c.layers[i].cumulative_length for c in caches)
    return out


def drop_front(cache, n: int, length: int) -> None:
    """Forget the first ``n`` of the ``length`` positions of every row (left padding no row needs any more), in
    place; a sliding-window layer, which keeps only its last keys, loses only those that fall before ``n``."""
    for layer in cache.layers:
        keep = min(layer.keys.shape[-2], length - n)
        layer.keys = layer.keys[..., layer.keys.shape[-2] - keep:, :]
        layer.values = layer.values[..., layer.values.shape[-2] - keep:, :]
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer counts the positions seen
            layer.cumulative_length = length - n


def extendable_copy(cache, config, rows: torch.Tensor, stop_after_layer: int | None):
    """A prompt cache holding rows ``rows`` of ``cache`` (or an empty one), which a prompt pass can extend."""
    if cache is None:
        return PromptCache(config, stop_after_layer)
    out = select_rows(cache, rows)
    if not isinstance(out, PromptCache):
        out.__class__ = PromptCache  # same state, plus the early stop
    out.stop_after_layer = stop_after_layer
    return out


def detach_stop(cache) -> None:
    """Turn a prompt cache into an ordinary cache that the answer pass can extend."""
    if isinstance(cache, PromptCache):
        cache.stop_after_layer = None


def static_copy(cache, config, max_cache_len: int):
    """A transformers ``StaticCache`` of ``max_cache_len`` positions holding what ``cache`` holds (a sliding-window
    layer keeps its window), for decoding with a compiled forward (``BituneModel.generate(compile=True)``)."""
    static = StaticCache(config=config, max_cache_len=max_cache_len)
    for i, layer in enumerate(cache.layers):
        keys, values = layer_kv(cache, i)
        seen = getattr(layer, "cumulative_length", keys.shape[-2])  # a sliding layer holds only its window's end
        window = getattr(static.layers[i], "max_cache_len", max_cache_len)
        if seen <= keys.shape[-2] or seen < window:
            static.update(keys, values, i)
            continue
        # A sliding layer that has seen more than its window holds the last window - 1 positions; transformers'
        # static sliding layer holds the last `window` ones and, once full, rolls one out before each new one is
        # written. Put ours at the end and count every position seen, so the next token rolls the unused slot out.
        pad = window - keys.shape[-2]
        static.update(F.pad(keys, (0, 0, pad, 0)), F.pad(values, (0, 0, pad, 0)), i)
        target = static.layers[i]
        target.cumulative_length_int = seen
        target.cumulative_length.fill_(seen)
    return static
