"""``bitune serve --compile``: a preallocated slot cache and a decoding step compiled once, at start.

The eager server (:class:`~bitune.serve.scheduler.EagerBatch`) keeps its running rows in a transformers cache
that grows by one position a step and is rebuilt whenever rows join (concatenated, padded) or leave (selected):
shapes change every step, so nothing can be compiled. Here every layer holds keys and values for ``slots`` rows x
``length`` positions, allocated once. A row holds its request's positions at columns 0..n-1 (column = position:
no padding), so each row writes its next key/value at its own column (a scatter) and attends under a mask made
from its position alone: columns up to it, and on a sliding-window layer (Gemma 3) only the window's last
``window`` of them (the layer stores every column; the mask keeps the window). Rows run compacted at the front:
the ``n`` running rows are rows 0..n-1, and a step runs rows ``[0, bucket)`` for the smallest batch-size bucket
>= n; rows n..bucket-1 are free slots whose computation is thrown away (their writes land in free slots, which a
joining request overwrites up to its length and masks beyond). A row that ends is replaced by the last row (its
written columns copied), so rows stay compacted at a copy per finished request rather than per step.

The step (the causal weights reading each row's pending token, as :func:`bitune.decoding.decode_step` does) is
compiled with ``torch.compile`` for every bucket when the engine is made, and run once per bucket on dummy rows,
so no request ever waits on a compile. The prompt is read as by the eager server (:meth:`BituneModel.prefill`:
both prompt passes, mixed, eager) and its cache copied into the row's slot. As vLLM does with CUDA graphs, the
batch is padded to a bucket; on CPU the buckets are compiled with inductor. The step attends with
:func:`bitune.attention.grouped_attention`: transformers' sdpa and eager functions copy every key/value head for
its query heads when a mask is given, which over a slot's whole length cost more than the rest of the step
outside its matrix products (measured: the compiled step at 8 rows went from 1.3x slower than the eager step to
slightly faster than it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from .. import cache as kv
from ..attention import GROUPED, attention_implementation
from ..masks import per_layer_type
from ..passes import Prefill


class SlotCache(Cache):
    """Per layer, keys and values of shape (slots, kv_heads, length, head_dim), written in place: a forward over
    the first b rows writes row r's new key/value (one position) at column ``write_at[r]`` and returns the first b
    rows whole, which the mask then limits.

    Args:
        layers: decoder layers.
        slots: rows held.
        kv_heads, head_dim: the model's key/value heads and their size.
        length: positions per row.
        dtype, device: of the keys and values.
    """

    def __init__(self, layers: int, slots: int, kv_heads: int, head_dim: int, length: int, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(layers=[])
        shape = (slots, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.write_at = torch.zeros(slots, dtype=torch.long, device=device)
        """(slots,) the column each row writes its next key/value at (its position)."""
        self.rows = torch.arange(slots, device=device)
        self.heads = torch.arange(kv_heads, device=device)
        for t in [*self.keys, *self.values, self.write_at, self.rows, self.heads]:
            torch._dynamo.mark_static_address(t)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write (b, kv_heads, 1, head_dim) keys/values at each row's column; return the b rows' whole keys/values."""
        b, heads = key_states.shape[:2]
        # on the whole buffer (not a view of its first b rows): inductor then writes in place, as it does for
        # transformers' StaticCache, instead of copying the buffer back after a functional scatter
        index = (self.rows[:b, None], self.heads[None], self.write_at[:b, None])  # (b, 1), (1, heads), (b, 1)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys.index_put_(index, key_states[:, :, 0])  # (b, heads, dim) at [row, head, column]
        values.index_put_(index, value_states[:, :, 0])
        return keys[:b], values[:b]

    def __len__(self) -> int:
        return len(self.keys)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given (position_ids); nothing asks a slot cache its length

    @property
    def nbytes(self) -> int:
        """Memory held by the keys and values."""
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])


def cache_shape(config, slots: int, length: int) -> tuple[int, tuple[int, int, int, int]]:
    """The layers of a slot cache over a model's text ``config`` and each layer's key (and value) shape
    ``(slots, kv_heads, length, head_dim)``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, (slots, config.num_key_value_heads, length, head_dim)


def cache_bytes(config, slots: int, length: int, dtype: torch.dtype) -> int:
    """Bytes the keys and values of a slot cache hold (:attr:`SlotCache.nbytes`), computed before allocating."""
    layers, shape = cache_shape(config, slots, length)
    return 2 * layers * math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def default_buckets(slots: int) -> list[int]:
    """Powers of two below ``slots``, and ``slots``: 16 -> [1, 2, 4, 8, 16]."""
    return sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)})


class SlotBatch:
    """The running rows of the server in a :class:`SlotCache`, decoded by a step compiled per batch-size bucket.

    The interface is the eager batch's (:class:`~bitune.serve.scheduler.EagerBatch`): :meth:`join` the rows of a
    prefill, :meth:`step` every row, :meth:`keep` some rows (returning the new order), :meth:`clear`.

    Args:
        model: a :class:`~bitune.model.BituneModel` in eval mode (merged or not).
        slots: rows held at most (the server's ``--max-batch-size``).
        length: positions per row (the server's ``--max-model-len``): a request's prompt and answer together.
        buckets: the batch sizes a step is compiled for (default :func:`default_buckets`); the largest must be
            ``slots``.
        compile: compile the step (default True); False runs the same step eagerly (tests, and a comparison).
    """

    def __init__(self, model, slots: int, length: int, buckets: list[int] | None = None, compile: bool = True):
        config = model.text_config
        if (why := model.layer_kinds.allows("compiled")) is not None:
            raise ValueError(f"a slot batch holds keys and values only: {why}")
        if slots < 1 or length < 2:
            raise ValueError(f"a slot batch needs slots >= 1 and length >= 2 (got {slots}, {length})")
        buckets = sorted(set(buckets or default_buckets(slots)))
        if buckets[0] < 1 or buckets[-1] != slots:
            raise ValueError(f"batch-size buckets {buckets} must be >= 1 and end at the slots ({slots})")
        param = next(model.parameters())
        self.model, self.slots, self.length, self.buckets = model, slots, length, buckets
        self.weights = model.weights
        self.dtype, self.device = param.dtype, param.device
        layers, (_, kv_heads, _, head_dim) = cache_shape(config, slots, length)
        self.cache = SlotCache(layers, slots, kv_heads, head_dim, length, self.dtype, self.device)
        self.positions = self.cache.write_at.view(slots, 1)  # (slots, 1) each row's pending token's position
        self.tokens = torch.zeros(slots, 1, dtype=torch.long, device=self.device)  # (slots, 1) pending tokens
        self.columns = torch.arange(length, device=self.device)  # (length,)
        self.n = 0
        if compile:  # one graph per bucket: past dynamo's recompile limit (8) a bucket would fall back to eager
            dynamo = torch._dynamo.config
            dynamo.recompile_limit = max(dynamo.recompile_limit, len(buckets) + 1)
        self._forward = torch.compile(self._logits, dynamic=False) if compile else self._logits
        self.compile_seconds = self.warm_up() if compile else 0.0

    # ------------------------------------------------------------------------------------------- the step
    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(b, 1) pending tokens at their (b, 1) positions -> (b, V) next-token logits; writes their keys/values."""

        def allowed(window: int | None) -> torch.Tensor:  # (b, 1, 1, length)
            ok = self.columns[None] <= positions  # (b, length): the row's columns so far and its own
            if window is not None:
                ok = ok & (self.columns[None] > positions - window)
            return ok[:, None, None]

        out = self.weights.call("causal", input_ids=tokens, position_ids=positions,
                                attention_mask=per_layer_type(allowed, self.model.text_config), cache=self.cache,
                                use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    @torch.inference_mode()
    def warm_up(self) -> float:
        """Run (and so compile) the step once for every bucket on free rows; returns the seconds it took. The
        rows' contents are left as they were (the dummy rows' writes land in column 0 of free slots)."""
        if self.n:
            raise RuntimeError("warm_up() runs before any row joins")
        start = time.perf_counter()
        with attention_implementation(self.weights.base, GROUPED):
            for b in self.buckets:
                self._forward(self.tokens[:b], self.positions[:b])
        return time.perf_counter() - start

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    # ------------------------------------------------------------------------------------------- rows
    @property
    def size(self) -> int:
        """Running rows."""
        return self.n

    def join(self, new: Prefill) -> None:
        """Copy the rows of a prefill (its mixed cache, left-padded) into the next free slots, compacted at column
        0, their pending tokens after them.

        Raises:
            ValueError: more rows than free slots, or a row whose prompt leaves no column for its answer.
        """
        k = new.mask.shape[0]
        if self.n + k > self.slots:
            raise ValueError(f"{k} rows do not fit: {self.n} of {self.slots} slots are taken")
        lengths = new.mask.sum(1).tolist()  # positions cached per row
        if max(lengths) >= self.length:
            raise ValueError(f"a prompt of {max(lengths) + 1} tokens leaves no room in {self.length} positions")
        rows = range(self.n, self.n + k)
        for layer in range(len(self.cache)):
            keys, values = kv.layer_kv(new.cache, layer)  # (k, heads, T_l, dim): a sliding layer may hold fewer
            held = new.mask[:, new.mask.shape[1] - keys.shape[2]:].bool()  # (k, T_l) which of them are real
            for r, slot in enumerate(rows):
                real = held[r]
                n = int(real.sum())
                self.cache.keys[layer][slot, :, lengths[r] - n:lengths[r]] = keys[r][:, real]
                self.cache.values[layer][slot, :, lengths[r] - n:lengths[r]] = values[r][:, real]
        self.positions[self.n:self.n + k, 0] = torch.tensor(lengths, device=self.device)
        self.tokens[self.n:self.n + k] = new.last_token
        self.n += k

    @torch.inference_mode()
    def step(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One decoding step of every running row: ``pick`` maps the (n, V) logits to the (n,) next tokens."""
        n, b = self.n, self.bucket(self.n)
        if int(self.positions[:n].max()) >= self.length:
            raise RuntimeError(f"a row passed the {self.length} positions of its slot")
        with attention_implementation(self.weights.base, GROUPED):
            logits = self._forward(self.tokens[:b], self.positions[:b])[:n]
        self.tokens[:n, 0] = pick(logits).reshape(-1).to(self.tokens)
        self.positions[:n] += 1

    def keep(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep`` (ascending) and compact them at the front: each row that leaves is replaced by the
        last row. Returns the new order: new row j is old row ``order[j]``."""
        order = list(range(self.n))
        for gone in sorted(set(order) - set(keep), reverse=True):  # rows past `gone` are kept ones (or gone)
            last = len(order) - 1
            if gone != last:
                self._move(last, gone)
                order[gone] = order[last]
            order.pop()
        self.n = len(order)
        return order

    def _move(self, src: int, dst: int) -> None:
        """Row ``src``'s written columns, pending token and position into row ``dst``."""
        written = int(self.positions[src, 0])
        for t in [*self.cache.keys, *self.cache.values]:
            t[dst, :, :written] = t[src, :, :written]
        self.tokens[dst] = self.tokens[src]
        self.positions[dst] = self.positions[src]

    def clear(self) -> None:
        """Drop every row (after a failed round); the slots' memory stays."""
        self.n = 0


__all__ = ["SlotCache", "SlotBatch", "default_buckets"]
