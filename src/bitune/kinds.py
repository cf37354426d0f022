"""Layer kinds: everything Bitune needs to know about one kind of decoder layer, one entry in one table.

A decoder layer is of the kind its transformers cache layer and its ``config.layer_types`` entry say
(:func:`layer_kinds`). For each kind, :data:`KINDS` holds:

- ``mask``: what each prompt pass hands it: the pass's 4D attention mask (causal, bidirectional, ...; with the
  layer's window), the 2D padding mask (recurrent and conv layers: their scans are causal by construction, and the
  models zero padded positions only when given the 2D mask), or nothing;
- ``sequence``: the per-position tensors it keeps in the cache, (B, h, T, d): mixed position by position, and
  selected, split, concatenated (left-padded), flattened and dropped along T;
- ``states``: the per-row states it keeps (``{state index: (B, ...)}``): mixed as a whole, rows selected, split and
  concatenated; they cannot be flattened, dropped at the front or extended by a later prompt;
- ``mix``: which mixing coefficient mixes each tensor (``k``, ``v``: the paper's; ``s``, ``c``: a recurrent and a
  conv state's, :mod:`bitune.mixer`);
- ``off``: the execution paths it rules out, each with the reason (:data:`PATHS`);
- ``refused``: why wrap refuses it, for kinds Bitune does not implement yet.

The cache (:mod:`bitune.cache`), masks (:mod:`bitune.masks`), the wrap checks (:mod:`bitune.support`), the mixer,
the fused forward, packed scoring and the compiled slot cache read this table; adding a kind of layer is one entry
here plus its tests (the contributing page says how).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PATHS: dict[str, str] = {
    "fused": "the fused forward (both prompt passes and the answer as one forward over 2T + A positions)",
    "packed": "packed scoring (many continuations of a prompt as one row against its flattened cache)",
    "compiled": "compiled decoding from a static cache (generate(compile=True), serve --compile)",
    "extend": "reading a new prompt on top of a conversation's cache (chat mode 'alternate')",
}
"""The execution paths a kind may rule out; every other path (prompt passes one by one or batched over rows, the
answer pass, decoding, merging) works for every implemented kind."""


@dataclass(frozen=True)
class LayerKind:
    """What Bitune needs to know about one kind of decoder layer (the module docstring explains the fields)."""

    name: str
    doc: str
    mask: str = "attention"
    """``"attention"`` (the pass's 4D mask), ``"padding"`` (the 2D padding mask) or ``"none"``."""
    window: str | None = None
    """The config field holding the layer's attention window (keys further than it are blocked), or None."""
    chunk: str | None = None
    """The config field holding the layer's chunk size (a query reads keys of its own chunk only), or None."""
    sequence: tuple[str, ...] = ("keys", "values")
    states: tuple[str, ...] = ()
    mix: tuple[tuple[str, str], ...] = (("keys", "k"), ("values", "v"))
    off: tuple[tuple[str, str], ...] = ()
    refused: str | None = None
    types: tuple[str, ...] = ()
    """The ``config.layer_types`` entries this kind covers (a model without layer types has attention layers)."""
    masks: tuple[tuple[str, str], ...] = ()
    """Further keys of a per-layer-type mask dict this kind's layers read, with their form (Falcon-H1's hybrid
    layers read ``"full_attention"`` and ``"linear_attention"``)."""

    @property
    def writes(self) -> frozenset[str]:
        """What a forward of this layer writes into the cache: ``"kv"``, ``"indexer"``, ``"conv"``, ``"recurrent"`` (a prompt pass
        may stop once its last writing layer has written all of them)."""
        names = {"keys": "kv", "values": "kv", "indexer_keys": "indexer", "conv_states": "conv",
                 "recurrent_states": "recurrent"}
        return frozenset(names[t] for t in (*self.sequence, *self.states))

    def allows(self, path: str) -> bool:
        """Whether this kind allows the execution path ``path`` (one of :data:`PATHS`)."""
        return path not in dict(self.off)


_SCAN = ("a scan runs once over its rows' tokens: one forward cannot hold two passes' scans side by side in one row")
_STATE = ("its state is one per row, not one per position")
_CHUNKS = "its chunks are counted on the real tokens of one prompt pass per row, which this path lays out otherwise"
_BIAS = ("its bias is built from one prompt pass's positions per row (the queries are the last of the keys), "
         "which this path lays out otherwise")

KINDS: dict[str, LayerKind] = {k.name: k for k in (
    LayerKind("full_attention", "attention over every earlier (causal pass) or every (bidirectional pass) prompt "
              "token; keys and values mixed (the paper, eq. 6-7). MLA layers cache their keys and values alike.",
              types=("full_attention", "global")),
    LayerKind("sliding_attention", "attention within a window of ``sliding_window`` tokens, on both sides in the "
              "bidirectional pass; keys and values mixed", window="sliding_window", types=("sliding_attention",)),
    LayerKind("local_attention", "attention within the last ``window_size`` tokens that the model applies with a "
              "boolean buffer of its own (GPT-Neo's local layers; its global layers are full attention with one "
              "too): the buffers are opened at wrap, the local one to the symmetric window |i - j| < window_size, so "
              "the pass's mask decides the direction (bitune.attention.open_own_masks); keys and values mixed",
              types=("local",),
              off=(("fused", "its window is a buffer over the forward's positions, which the fused sequence lays "
                             "out as two passes and an answer"),
                   ("packed", "its window is a buffer over the forward's positions, which packing reorders"))),
    LayerKind("recurrent", "a linear-attention or SSM layer (Gated DeltaNet, Mamba2, KDA, ...) with a short causal "
              "convolution: its own causal scan in both passes, each pass with its own adapters, on the 2D padding "
              "mask; the decoding cache holds a learnt convex mix of the two passes' final states, "
              "S = (1 - a_s) S_causal + a_s S_bidir, and of their conv states with a_c",
              mask="padding", sequence=(), states=("recurrent_states", "conv_states"),
              mix=(("recurrent_states", "s"), ("conv_states", "c")), types=("linear_attention", "mamba"),
              off=(("fused", _SCAN), ("packed", _STATE), ("compiled", _STATE + " and the slot cache holds keys "
                   "and values only"), ("extend", "a mixed state cannot be extended by a later prompt's passes"))),
    LayerKind("conv", "a short causal convolution without a recurrent state (LFM2's conv layers): its own causal "
              "convolution in both passes on the 2D padding mask; the decoding cache holds a learnt convex mix of the "
              "two passes' conv states with a_c", mask="padding", sequence=(), states=("conv_states",),
              mix=(("conv_states", "c"),), types=("conv",),
              off=(("fused", _SCAN), ("packed", _STATE), ("compiled", _STATE + " and the slot cache holds keys "
                   "and values only"), ("extend", "a mixed state cannot be extended by a later prompt's passes"))),
    LayerKind("attention_and_recurrent", "attention and an SSM side by side in one layer (Falcon-H1): keys and "
              "values mixed as in full attention, the SSM's states as in a recurrent layer",
              states=("recurrent_states", "conv_states"),
              mix=(("keys", "k"), ("values", "v"), ("recurrent_states", "s"), ("conv_states", "c")), types=("hybrid",),
              masks=(("full_attention", "attention"), ("linear_attention", "padding")),
              off=(("fused", _SCAN), ("packed", _STATE), ("compiled", _STATE),
                   ("extend", "a mixed state cannot be extended by a later prompt's passes"))),
    LayerKind("stateless", "an MLP or MoE block without attention or state (Nemotron-H): nothing cached, nothing "
              "mixed; it sees later tokens through the attention layers below it",
              mask="none", sequence=(), mix=(), types=("mlp", "moe")),
    LayerKind("chunked_attention", "attention within fixed chunks of ``attention_chunk_size`` positions (Llama 4): "
              "chunk = position // chunk size, positions counting real tokens; within its chunk a query reads the "
              "earlier (causal pass) or every (bidirectional pass) prompt token; keys and values mixed",
              chunk="attention_chunk_size", types=("chunked_attention",),
              off=(("fused", _CHUNKS), ("packed", _CHUNKS), ("compiled", _CHUNKS),
                   ("extend", "a later prompt's chunks continue the conversation's positions, which its passes' "
                              "masks do not count"))),
    LayerKind("alibi_attention", "full attention with ALiBi position biases (Bloom, MPT): in the prompt passes the "
              "bias is the symmetric -m_h |i - j|, built per forward by the model's own builder replaced at wrap "
              "(bitune.attention.symmetric_alibi); under the causal mask it is the model's own; keys and values mixed",
              off=(("fused", _BIAS), ("packed", _BIAS), ("compiled", _BIAS),
                   ("extend", "a later prompt's bias would have to count the conversation's positions"))),
    LayerKind("indexed_attention", "attention over the prompt keys a learnt indexer selects (DeepSeek-V3.2's and "
              "GLM-5's DSA): the indexer scores keys under the layer's mask before its top-k, so in the bidirectional "
              "pass it selects among all prompt keys; its keys (``indexer_keys``, (B, T, d)) are mixed with a_k, the "
              "keys' coefficient: they are keys too, and the answer's indexer then ranks the same mixed prompt its "
              "attention reads (taking the causal pass's alone would rank a prompt the attention does not read); keys "
              "and values mixed", sequence=("keys", "values", "indexer_keys"), types=("indexed_attention",),
              mix=(("keys", "k"), ("values", "v"), ("indexer_keys", "k")),
              off=(("fused", "the fused forward's cache keeps no indexer keys"),
                   ("packed", "its indexer ranks keys under the forward's own mask, not in packed scoring's block "
                              "layout"),
                   ("compiled", "the slot cache keeps no indexer keys"))),
    LayerKind("relative_attention", "attention with learnt relative-position logits and short convolutions on its "
              "keys and values (Inkling)", types=("hybrid_sliding",),
              refused="its relative-position logits are learnt for backward distances only (zero for later tokens), "
                      "so a bidirectional pass would read later tokens without position information: not defined yet"),
    LayerKind("compressed_attention", "attention over keys compressed block by block, with or without a sparse "
              "selection (DeepSeek-V4)", types=("compressed_sparse_attention", "heavily_compressed_attention"),
              refused="its keys are compressed block by block: how a bidirectional pass compresses later tokens, "
                      "and which pass's compressed blocks the answer reads, is not defined yet"),
    LayerKind("shared_kv", "a layer that reuses an earlier layer's keys and values (Gemma 3n's KV sharing)",
              mask="attention", sequence=(), mix=(),
              refused="its last layers reuse earlier layers' keys and values (KV sharing): which pass's keys a "
                      "sharing layer reads is not defined"),
)}
"""Every layer kind Bitune knows, by name."""

CACHE_LAYERS: dict[str, str] = {
    "DynamicLayer": "full_attention",
    "DynamicSlidingWindowLayer": "sliding_attention",
    "DynamicIndexedLayer": "indexed_attention",
    "LinearAttentionLayer": "recurrent",
    "LinearAttentionAndFullAttentionLayer": "attention_and_recurrent",
    "DummyLayer": "stateless",
}
"""transformers cache-layer class -> the kind it holds (before :data:`LAYER_TYPES` refines it)."""

LAYER_TYPES: dict[str, str] = {
    "conv": "conv",
    "local": "local_attention",
    "chunked_attention": "chunked_attention",
    "indexed_attention": "indexed_attention",
    "hybrid_sliding": "relative_attention",
    "compressed_sparse_attention": "compressed_attention",
    "heavily_compressed_attention": "compressed_attention",
}
"""``config.layer_types`` entries that decide the kind whatever cache layer they use (chunked layers use a
sliding-window cache layer)."""

BIASED: dict[str, str] = {"bloom": "alibi_attention", "mpt": "alibi_attention",
                          **dict.fromkeys(("inkling_text", "inkling2_text", "inkling2_loop_text"), "relative_attention")}
"""Model types whose attention layers add a position bias of their own: the kind they are instead."""

SCANS_FROM_ZERO: dict[str, str] = {
    "zamba": "its Mamba layers scan a forward of several tokens from a zero state (the cached recurrent state is "
             "read one token at a time only), so the answer pass would not read the mixed state",
}
"""Model types whose recurrent layers ignore a cached state in a forward of several tokens, where wrap's own
check (states after 4 + 2 tokens equal those after 6) does not see it on a tiny model: refused with the reason."""

STATELESS_TYPES = ("mlp", "moe")
"""Layer types of blocks without attention; any other layer with a ``DummyLayer`` shares another's keys."""


@dataclass
class Layers:
    """The kind of every decoder layer of one model, and the layer types its forward keys masks by.

    Attributes:
        kinds: one :class:`LayerKind` per decoder layer.
        types: the model's own layer type per layer (``config.layer_types`` or its equivalent), or None where the
            model has one type; a per-layer-type mask dict is keyed by these.
    """

    kinds: list[LayerKind]
    types: list[str] | None = None
    by_type: dict[str, LayerKind] = field(default_factory=dict)
    unknown: str | None = None
    """Why the layers' kinds are unknown (a baseline that runs the model as it is, one causal pass with the model's
    own masks, needs none of them); None when every layer's kind is known."""

    def __post_init__(self) -> None:
        if self.types is not None:
            self.by_type = dict(zip(self.types, self.kinds))

    def allows(self, path: str) -> str | None:
        """None if every layer allows ``path``, else why not (the first layer that rules it out)."""
        for i, kind in enumerate(self.kinds):
            if not kind.allows(path):
                return f"layer {i} is of kind {kind.name}: {dict(kind.off)[path]}"
        return None

    @property
    def names(self) -> set[str]:
        return {k.name for k in self.kinds}

    @property
    def stateful(self) -> bool:
        """Whether some layer keeps a per-row state (recurrent or conv)."""
        return any(k.states for k in self.kinds)

    def stop(self) -> tuple[int, frozenset[str]] | None:
        """Where a prompt pass may stop: the last layer that writes into the cache and what it writes."""
        for i in range(len(self.kinds) - 1, -1, -1):
            if self.kinds[i].writes:
                return i, self.kinds[i].writes
        return None

    @property
    def mixes(self) -> set[str]:
        """The mixing coefficients some layer uses (``k``, ``v``, ``s``, ``c``)."""
        return {c for k in self.kinds for _, c in k.mix}


def model_layer_types(text_config) -> list[str] | None:
    """The model's own type of each decoder layer (what its forward keys a mask dict by), or None."""
    for name in ("layer_types", "layers_block_type", "attention_layers"):
        types = getattr(text_config, name, None)
        if isinstance(types, (list, tuple)) and len(types) == text_config.num_hidden_layers:
            return [str(t) for t in types]
    return None


def kind_of(cache_layer, layer_type: str | None) -> LayerKind | None:
    """The kind of a decoder layer from the cache layer it filled and its layer type; None if no kind covers it."""
    if layer_type in LAYER_TYPES:
        return KINDS[LAYER_TYPES[layer_type]]
    name = next((c.__name__ for c in type(cache_layer).__mro__ if c.__name__ in CACHE_LAYERS), None)
    if name is None:
        return None
    if name == "DummyLayer" and layer_type not in STATELESS_TYPES:
        return KINDS["shared_kv"]
    kind = KINDS[CACHE_LAYERS[name]]
    return kind if layer_type is None or layer_type in kind.types else None


def layer_kinds(cache, text_config) -> tuple[Layers | None, str | None]:
    """Every decoder layer's kind, from a cache one forward filled; ``(None, why)`` for the first layer no
    implemented kind covers."""
    types = model_layer_types(text_config)
    held = list(getattr(cache, "layers", []))
    if len(held) > text_config.num_hidden_layers:
        return None, (f"its cache holds {len(held)} layers for {text_config.num_hidden_layers} decoder layers (a "
                      "layout of its own, such as copies per recurrence loop)")
    kinds = []
    for i in range(text_config.num_hidden_layers):
        layer = held[i] if i < len(held) else None
        kind = kind_of(layer, types[i] if types else None) if layer is not None else None
        if kind is None:
            what = type(layer).__name__ if layer is not None else "nothing"
            typed = f" (layer type {types[i]!r})" if types else ""
            return None, f"decoder layer {i}{typed} keeps {what} in the cache, which no layer kind covers"
        if "keys" in kind.sequence and getattr(text_config, "model_type", None) in BIASED:
            kind = KINDS[BIASED[text_config.model_type]]
        if kind.refused:
            return None, f"decoder layer {i} is of kind {kind.name}: {kind.refused}"
        kinds.append(kind)
    if getattr(text_config, "model_type", None) in SCANS_FROM_ZERO:
        return None, SCANS_FROM_ZERO[text_config.model_type]
    if not any(k.mask == "attention" for k in kinds):
        return None, "no layer can read later tokens (no attention layer), so there is no bidirectional pass"
    return Layers(kinds, types), None


__all__ = ["BIASED", "CACHE_LAYERS", "KINDS", "SCANS_FROM_ZERO", "LAYER_TYPES", "LayerKind", "Layers", "PATHS", "kind_of", "layer_kinds",
           "model_layer_types"]
