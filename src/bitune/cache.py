"""Reading and building caches: the one place that touches transformers' Cache internals.

What a layer keeps is its kind's (:mod:`bitune.kinds`): per-position tensors (attention keys and values, (B, h, T,
d); an indexer's keys, (B, T, d)) and per-row states (a recurrent layer's ``recurrent_states`` and ``conv_states``, ``{state index: (B, ...)}``).
Every operation here works on both as the kind says: rows are selected, split and concatenated in both; only
per-position tensors are padded, flattened or dropped along T.

A prompt pass fills a :class:`PromptCache`, which ends the forward as soon as the last writing layer has written
what it keeps: only the cache reaches the answer, so the rest of that layer, the final norm and lm_head would be
wasted work. Two prompt caches are mixed layer by layer into the first one (paper eq. 6-7, and the states' mix).
The fused forward's stand-in cache, which stores nothing, lives with that path (:class:`bitune.fused.FusedCache`).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, StaticCache

from .kinds import KINDS, LayerKind, Layers, kind_of


class PassComplete(Exception):
    """Raised inside a prompt pass once every layer's keys and values are in the cache."""


class AssigningStates:
    """A recurrent cache layer that assigns its new states instead of copying them into the old tensors (what
    transformers does, for cudagraphs' static addresses): the states of a prompt pass are mixed, and a backward
    through a mixed state fails if the answer pass writes into it in place."""

    def update_conv_state(self, conv_states, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs):
        if not self.is_conv_states_initialized[state_idx]:
            self.lazy_initialization(conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size)
        size = self.conv_kernel_size[state_idx]
        if self.has_previous_state[state_idx]:
            full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)  # (B, C, k + T)
        else:
            self.has_previous_state[state_idx] = True
            full = F.pad(conv_states, (max(size - conv_states.shape[-1], 0), 0))  # (B, C, max(k, T))
        self.conv_states[state_idx] = full[..., -size:]  # (B, C, k)
        return full

    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        if not self.is_recurrent_states_initialized[state_idx]:
            self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states


_ASSIGNING: dict[type, type] = {}


def assigning(layer) -> None:
    """Make a recurrent cache layer :class:`AssigningStates` (in place; other layers are left as they are)."""
    cls = type(layer)
    if cls in _ASSIGNING.values() or not hasattr(layer, "recurrent_states"):
        return
    if cls not in _ASSIGNING:  # a subclass of the layer's own class alone, so its instances keep their layout
        _ASSIGNING[cls] = type(f"Assigning{cls.__name__}", (cls,), {
            "update_conv_state": AssigningStates.update_conv_state,
            "update_recurrent_state": AssigningStates.update_recurrent_state})
    layer.__class__ = _ASSIGNING[cls]


class PromptCache(DynamicCache):
    """A DynamicCache that can stop the forward right after the last writing layer has written what it keeps.

    Args:
        config: the model's text config (decides each layer's cache layer).
        stop_after: ``(layer index, what it writes)`` (:meth:`bitune.kinds.Layers.stop`) after whose writes the
            forward is cut short; None never stops.
    """

    def __init__(self, config, stop_after: tuple[int, frozenset[str]] | None = None):
        super().__init__(config=config)
        for layer in self.layers:
            assigning(layer)
        self.stop_after = stop_after
        self._written: set[str] = set()

    def _wrote(self, layer_idx: int, what: str) -> None:
        if self.stop_after is not None and layer_idx == self.stop_after[0]:
            self._written.add(what)
            if self._written >= self.stop_after[1]:
                self._written = set()
                raise PassComplete

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        self._wrote(layer_idx, "kv")
        return out

    def update_indexer(self, indexer_key_states, layer_idx, *args, **kwargs):
        out = super().update_indexer(indexer_key_states, layer_idx, *args, **kwargs)
        self._wrote(layer_idx, "indexer")
        return out

    def update_conv_state(self, conv_states, layer_idx, *args, **kwargs):
        out = super().update_conv_state(conv_states, layer_idx, *args, **kwargs)
        self._wrote(layer_idx, "conv")
        return out

    def update_recurrent_state(self, recurrent_states, layer_idx, *args, **kwargs):
        out = super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)
        self._wrote(layer_idx, "recurrent")
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
        self._states: dict[int, dict] = {}  # a recurrent layer's states before the first run wrote them
        self._indexer: dict[int, torch.Tensor | None] = {}  # an indexed layer's indexer keys before the first run
        self._stops: set[tuple[str, int]] = set()  # the state writes after which the first run's pass stopped
        self.replaying = False  # set by the recomputation (bitune.recompute) before it runs the layer again

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def _before(self, layer_idx: int) -> dict:
        """A recurrent layer's states as the first run found them (snapshotted at its first state access)."""
        if layer_idx not in self._states:
            layer = self._cache.layers[layer_idx]
            self._states[layer_idx] = {name: dict(getattr(layer, name)) for name in
                                       ("conv_states", "recurrent_states", "has_previous_state")}
        return self._states[layer_idx]

    def _state(self, name: str, layer_idx: int, state_idx: int):
        """The layer's ``name`` state: the cache's on the first run, the one the first run found on the replay."""
        before = self._before(layer_idx)
        if not self.replaying:
            return getattr(self._cache, f"get_{name[:-1]}")(layer_idx, state_idx)  # get_conv_state, ...
        return before[name].get(state_idx) if before["has_previous_state"].get(state_idx) else None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._state("conv_states", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._state("recurrent_states", layer_idx, state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        if layer_idx is None or not self.replaying:
            return self._cache.has_previous_state(layer_idx, state_idx)
        return bool(self._before(layer_idx)["has_previous_state"].get(state_idx or 0))

    def _write(self, key: tuple[str, int], write, replayed):
        """The first run's ``write()`` (remembering a pass that stopped there), or on the replay ``replayed()``,
        which writes nothing, stopping where the first run stopped."""
        if not self.replaying:
            try:
                return write()
            except PassComplete:
                self._stops.add(key)
                raise
        out = replayed()
        if key in self._stops:
            raise PassComplete
        return out

    def update_conv_state(self, conv_states, layer_idx: int, state_idx: int = 0, conv_kernel_size=None, **kwargs):
        before = self._before(layer_idx)

        def replayed():  # what the first run returned: the state before it, then the new inputs
            size = self._cache.layers[layer_idx].conv_kernel_size[state_idx]
            if before["has_previous_state"].get(state_idx):
                return torch.cat([before["conv_states"][state_idx], conv_states], dim=-1)
            return F.pad(conv_states, (max(size - conv_states.shape[-1], 0), 0))

        return self._write(("conv", layer_idx), lambda: self._cache.update_conv_state(
            conv_states, layer_idx, state_idx=state_idx, conv_kernel_size=conv_kernel_size, **kwargs), replayed)

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        self._before(layer_idx)
        return self._write(("recurrent", layer_idx), lambda: self._cache.update_recurrent_state(
            recurrent_states, layer_idx, state_idx=state_idx, **kwargs), lambda: recurrent_states)

    def update_indexer(self, indexer_key_states, layer_idx: int, *args, **kwargs):
        if not self.replaying:
            layer = self._cache.layers[layer_idx]
            held = getattr(layer, "indexer_keys", None)
            self._indexer[layer_idx] = held if held is not None and held.numel() else None
        before = self._indexer.get(layer_idx)
        return self._write(("indexer", layer_idx), lambda: self._cache.update_indexer(
            indexer_key_states, layer_idx, *args, **kwargs), lambda: indexer_key_states if before is None else
            torch.cat([before, indexer_key_states], dim=-2))

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
    """Keys and values of one attention layer, each (B, n_kv_heads, T, head_dim)."""
    return cache.layers[layer].keys, cache.layers[layer].values


def layer_tensors(cache, layer: int) -> list[torch.Tensor]:
    """Everything one layer keeps (its keys and values, or its states), in a fixed order."""
    held = cache.layers[layer]
    kind = _kind(held)
    out = [getattr(held, name) for name in kind.sequence if getattr(held, name, None) is not None]
    for name in kind.states:
        out += [t for _, t in sorted(getattr(held, name).items()) if t is not None]
    return out


def num_layers(cache) -> int:
    return len(cache.layers)


def _kind(layer) -> LayerKind:
    """The kind whose tensors ``layer`` holds (by its cache-layer class; attention for an unknown one)."""
    return kind_of(layer, None) or KINDS["full_attention"]


def _copy(cache):
    """A shallow copy of ``cache`` whose layers and state dicts can be reassigned without touching the original."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in out.layers:
        for name in ("conv_states", "recurrent_states", "has_previous_state"):
            if isinstance(getattr(layer, name, None), dict):
                setattr(layer, name, dict(getattr(layer, name)))
    return out


def _apply(cache, sequence, state) -> None:
    """In place, per layer: ``sequence(layer, name, x)`` -> the new per-position tensor (B, h, T, d) and
    ``state(layer, name, x)`` -> the new per-row state (B, ...), for every tensor the layer's kind keeps."""
    for layer in cache.layers:
        kind = _kind(layer)
        for name in kind.sequence:
            if getattr(layer, name, None) is not None:
                setattr(layer, name, sequence(layer, name, getattr(layer, name)))
        for name in kind.states:
            held = getattr(layer, name)
            for i in held:
                if held[i] is not None:  # a state this layer does not keep (LFM2's conv layers: no recurrent one)
                    held[i] = state(layer, name, held[i])


def mix_into(cache_causal, cache_bidir, mix, layers: Layers, start: int = 0) -> None:
    """Replace what every layer of ``cache_causal`` keeps by its mix with ``cache_bidir``'s, as each layer's kind
    says (:attr:`bitune.kinds.LayerKind.mix`): ``mix.mix(layer, coefficient, causal, bidir)``; a coefficient the
    mixer does not have (a variant that keeps the causal pass's states) leaves the causal tensor.

    Args:
        start: positions before ``start`` (a shared history both caches extended) are kept as they are; per-row
            states cannot be mixed then (they hold the history too).
    """
    if num_layers(cache_causal) != num_layers(cache_bidir):
        raise ValueError("prompt caches have different numbers of layers")
    for i, (lc, lb) in enumerate(zip(cache_causal.layers, cache_bidir.layers)):
        for name, coefficient in layers.kinds[i].mix:
            if not mix.has(coefficient):
                continue
            if name in layers.kinds[i].states:
                if start:
                    raise ValueError(f"layer {i} keeps a per-row {name}, which cannot be mixed after a history")
                causal, bidir = getattr(lc, name), getattr(lb, name)
                setattr(lc, name, {j: mix.mix(i, coefficient, causal[j], bidir[j]) for j in causal})
                continue
            c, b = getattr(lc, name), getattr(lb, name)
            mixed = mix.mix(i, coefficient, c[..., start:, :], b[..., start:, :])
            setattr(lc, name, torch.cat([c[..., :start, :], mixed], dim=-2) if start else mixed)


def split_rows(cache, sizes: list[int]) -> list:
    """Split a cache along the batch dimension into independent caches (after one batched forward)."""
    parts = []
    start = 0
    for size in sizes:
        part = _copy(cache)
        _apply(part, lambda _l, _n, x, a=start, b=start + size: x[a:b], lambda _l, _n, x, a=start, b=start + size: x[a:b])
        parts.append(part)
        start += size
    return parts


def select_rows(cache, index: torch.Tensor):
    """A new cache whose row r is row ``index[r]`` of ``cache``; the original is left untouched.

    Args:
        cache: a filled cache with batch size B.
        index: (B',) LongTensor of rows to take (repeats allowed).
    """
    out = _copy(cache)
    take = lambda _l, _n, x: x.index_select(0, index.to(x.device))  # noqa: E731
    _apply(out, take, take)
    return out


def keys_per_window(cache) -> dict[int | None, int]:
    """Keys per row held by a filled cache's attention layers, by their sliding window (None: full attention); a
    sliding-window layer keeps only its last ``window - 1``."""
    return {(layer.sliding_window if getattr(layer, "is_sliding", False) else None): layer.keys.shape[-2]
            for layer in cache.layers if "keys" in _kind(layer).sequence and getattr(layer, "keys", None) is not None}


def flatten_rows(cache, rows: torch.Tensor):
    """A new one-row cache holding rows ``rows`` of ``cache`` one after another along the sequence: layer keys
    (B, h, T, d) become (1, h, len(rows) * T, d). For a packed answer pass whose mask keeps each row's tokens
    on its own keys (:mod:`bitune.scoring`); the original is left untouched. Per-row states cannot be flattened
    (a ValueError: the kind rules packed scoring out)."""
    out = _copy(cache)

    def flat(_layer, _name, x):
        if x.dim() == 3:  # an indexer's keys (B, T, d)
            return x.index_select(0, rows.to(x.device)).reshape(1, -1, x.shape[-1])  # (1, R*T, d)
        x = x.transpose(0, 1).index_select(1, rows.to(x.device))  # (h, R, T, d)
        return x.reshape(1, x.shape[0], -1, x.shape[3])  # (1, h, R*T, d): a view, one copy in all

    def refuse(_layer, name, _x):
        raise ValueError(f"a per-row {name} cannot be flattened into one row (packed scoring)")

    _apply(out, flat, refuse)
    return out


def concat_rows(caches: list):
    """One cache holding the rows of ``caches`` one after another (batch dimension); each layer's keys/values are
    left-padded with zeros to the longest among them (for left-padded prompts whose masks are padded alike);
    per-row states are stacked as they are."""
    out = _copy(caches[0])
    for i, layer in enumerate(out.layers):
        kind = _kind(layer)
        for name in kind.sequence:
            parts = [getattr(c.layers[i], name) for c in caches]  # (B_j, h, T_j, d) or (B_j, T_j, d)
            if parts[0] is None:
                continue
            T = max(x.shape[-2] for x in parts)
            setattr(layer, name, torch.cat([F.pad(x, (0, 0, T - x.shape[-2], 0)) for x in parts]))
        for name in kind.states:
            held = getattr(layer, name)
            for j in held:
                if held[j] is not None:
                    held[j] = torch.cat([getattr(c.layers[i], name)[j] for c in caches])
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer: positions seen by the longest row
            layer.cumulative_length = max(c.layers[i].cumulative_length for c in caches)
    return out


def drop_front(cache, n: int, length: int) -> None:
    """Forget the first ``n`` of the ``length`` positions of every row (left padding no row needs any more), in
    place; a sliding-window layer, which keeps only its last keys, loses only those that fall before ``n``; per-row
    states are kept (left padding never entered them)."""
    for layer in cache.layers:
        for name in _kind(layer).sequence:
            x = getattr(layer, name, None)
            if x is None:
                continue
            keep = min(x.shape[-2], length - n)
            setattr(layer, name, x[..., x.shape[-2] - keep:, :])
        if hasattr(layer, "cumulative_length"):  # a sliding-window layer counts the positions seen
            layer.cumulative_length = length - n


def extendable_copy(cache, config, rows: torch.Tensor, stop_after: tuple[int, frozenset[str]] | None):
    """A prompt cache holding rows ``rows`` of ``cache`` (or an empty one), which a prompt pass can extend."""
    if cache is None:
        return PromptCache(config, stop_after)
    out = select_rows(cache, rows)
    if not isinstance(out, PromptCache):
        out.__class__ = PromptCache  # same state, plus the early stop
    out._written = set()  # its own: a shallow copy would share the history's (a layer writing two things stops early)
    out.stop_after = stop_after
    return out


def detach_stop(cache) -> None:
    """Turn a prompt cache into an ordinary cache that the answer pass can extend."""
    if isinstance(cache, PromptCache):
        cache.stop_after = None


def static_copy(cache, config, max_cache_len: int):
    """A transformers ``StaticCache`` of ``max_cache_len`` positions holding what ``cache`` holds (a sliding-window
    layer keeps its window), for decoding with a compiled forward (``BituneModel.generate(compile=True)``)."""
    static = StaticCache(config=config, max_cache_len=max_cache_len)
    for i, layer in enumerate(cache.layers):
        if _kind(layer).states or not _kind(layer).sequence:
            raise ValueError(f"layer {i} keeps per-row states: {dict(_kind(layer).off).get('compiled', 'no static copy')}")
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
