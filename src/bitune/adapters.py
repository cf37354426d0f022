"""The two weight sets of a Bitune model ("causal" and "bidir") on one Hugging Face model.

:class:`WeightSets` owns the base model and the sets, and delegates what differs between training methods (how
the sets are created, which parameters each trains, how a bidir forward runs and how the sets merge) to the
method's strategy in :mod:`bitune.methods`. A forward with different weights on different rows or positions
(the batched and fused paths) is computed explicitly for plain LoRA: :func:`routed` makes each LoRA layer
compute :func:`routed_lora_forward` for the length of one forward.

:func:`routed` is the only place that changes how a PEFT LoRA layer computes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from peft import PeftModel
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .config import BituneConfig
from .errors import BituneError
from .methods import STRATEGIES
from .recompute import recorded

WEIGHT_SETS = ("causal", "bidir")


class RoutingError(RuntimeError):
    """A LoRA layer sees its input in a layout a per-row or per-position routing cannot be placed on."""


@dataclass
class Routing:
    """Which adapter each block of rows (``dim=0``) or positions (``dim=1``) of a forward uses.

    Attributes:
        blocks: ``(adapter name, size)`` in order; the sizes add up to the batch size (rows) or the sequence
            length (positions).
        dim: 0 for rows, 1 for positions.
    """

    blocks: list[tuple[str, int]]
    dim: int = 0
    batch: tuple[int, int] | None = None
    """(B, T): the rows and positions of the forward's input, to place the gates of a layer that sees its tokens
    in another layout (flattened to (B * T, d), or only the last positions of each row)."""
    _gates: dict = field(default_factory=dict, repr=False)

    def fit(self, gate: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``gate`` ((rows, 1, R) or (positions, R), from :meth:`gate` or :meth:`difference_gate`) laid out to
        multiply ``h`` (..., R), the low-rank activations of a layer's input of whatever shape it sees: (B, T, ...)
        as the model's input, tokens flattened to (B * T, ...) (OPT's MLP, shared experts), or (B, T', ...) with the
        last T' < T positions (a head after ``logits_to_keep``; positions only).

        Raises:
            RoutingError: a layout the gate cannot be placed on (tokens gathered per expert, say): the
                caller runs the weight sets one forward each instead.
        """
        lead, R = h.shape[:-1], h.shape[-1]
        if len(self.blocks) == 1:
            return gate.reshape(-1, R)[0]  # one block: the same gate everywhere
        B, T = self.batch if self.batch is not None else (None, None)
        flat = len(lead) == 1 and B is not None and lead[0] == B * T
        if self.dim == 0:
            if len(lead) >= 1 and lead[0] == gate.shape[0]:
                return gate.view(gate.shape[0], *[1] * (len(lead) - 1), R)  # (B, 1, ..., R)
            if flat:
                return gate.expand(B, T, R).reshape(B * T, R)
        else:
            N = gate.shape[0]
            if len(lead) >= 2 and lead[1] == N and (B is None or lead[0] == B):
                return gate.view(N, *[1] * (len(lead) - 2), R)  # (T, 1, ..., R)
            if len(lead) == 2 and lead[1] < N and (B is None or lead[0] == B):
                return gate[N - lead[1]:]  # the last positions (logits_to_keep)
            if flat:
                return gate.repeat(B, 1)  # (B * T, R)
        raise RoutingError(f"a layer's input {tuple(h.shape[:-1])} (+ features) cannot be routed per "
                           f"{'row' if self.dim == 0 else 'position'} for a forward of {self.batch}")

    @property
    def names(self) -> list[str]:
        """The adapters used, in order of first use."""
        return list(dict.fromkeys(name for name, _ in self.blocks))

    def gate(self, layer: LoraLinear, like: torch.Tensor) -> torch.Tensor:
        """(rows, 1, sets * r) or (positions, sets * r): each block's scaling on its own adapter's r columns, 0 on
        the others. Cached per (ranks, scalings, dtype, device): one gate serves every layer of the same shape."""
        names = self.names
        ranks = tuple(layer.r[n] for n in names)
        scales = tuple(layer.scaling[n] for n in names)
        key = (ranks, scales, like.dtype, like.device)
        if key not in self._gates:
            cols = torch.tensor([i for i, r in enumerate(ranks) for _ in range(r)], device=like.device)  # (sets*r,)
            owner = torch.tensor([names.index(n) for n, size in self.blocks for _ in range(size)],
                                 device=like.device)  # (N,)
            scale = torch.tensor([scales[i] for i in cols.tolist()], dtype=like.dtype, device=like.device)
            g = (owner[:, None] == cols[None, :]).to(like.dtype) * scale  # (N, sets * r)
            self._gates[key] = g[:, None, :] if self.dim == 0 else g
        return self._gates[key]

    def difference_gate(self, layer: LoraLinear, like: torch.Tensor) -> torch.Tensor:
        """For a layer whose base weight holds the causal set merged: (rows, 1, 2r) or (positions, 2r) gates on
        the columns ``[bidir | causal]``: ``+s_bidir`` and ``-s_causal`` on a bidir block (its weight is the merged
        one plus ``s_b B_b A_b - s_c B_c A_c``), 0 on a causal block (the merged weight alone)."""
        key = ("difference", layer.r["bidir"], layer.r["causal"], layer.scaling["bidir"], layer.scaling["causal"],
               like.dtype, like.device)
        if key not in self._gates:
            row = [layer.scaling["bidir"]] * layer.r["bidir"] + [-layer.scaling["causal"]] * layer.r["causal"]
            signed = torch.tensor(row, dtype=like.dtype, device=like.device)  # (2r,)
            bidir = torch.tensor([name == "bidir" for name, size in self.blocks for _ in range(size)],
                                 device=like.device)  # (N,)
            g = bidir[:, None].to(like.dtype) * signed[None, :]  # (N, 2r)
            self._gates[key] = g[:, None, :] if self.dim == 0 else g
        return self._gates[key]


def routed_lora_forward(layer: LoraLinear, x: torch.Tensor, routing: Routing, *args, **kwargs) -> torch.Tensor:
    """What a LoRA layer computes when each block of rows or positions of ``x`` uses its own adapter.

    With one adapter this is PEFT's own LoRA forward: ``base(x) + B(A(dropout(x))) * scaling``. With several,
    the frozen base projection runs once over everything, then all adapters' low-rank updates in two matrix
    products: ``x [A_1; A_2]^T`` (B, T, sets * r) is gated so that each block keeps only its own adapter's r
    columns (times that adapter's scaling), then multiplied by ``[B_1, B_2]``. That costs as many operations as
    one adapter, with gradients to every adapter.

    When the layer holds the causal set merged into its base weight (inference, :meth:`WeightSets.merge`), a
    causal block runs the base projection alone and a bidir block adds the difference of the two sets,
    ``s_b B_b A_b - s_c B_c A_c``, as one rank-2r product ``[B_b | B_c] (gate * [A_b; A_c] x)``.

    Args:
        layer: a PEFT LoRA ``Linear``, unmerged or with exactly the causal set merged.
        x: (B, T, d_in) the layer's input.
        routing: the adapter of each block.

    Returns:
        (B, T, d_out), in the base projection's dtype.
    """
    result = layer.base_layer(x, *args, **kwargs)  # (B, T, d_out)
    names = routing.names
    if layer.merged:  # the causal set is in the base weight: a bidir block adds the rank-2r difference
        if names == ["causal"]:
            return result
        weight_a = torch.cat([layer.lora_A["bidir"].weight, layer.lora_A["causal"].weight])  # (2r, d_in)
        weight_b = torch.cat([layer.lora_B["bidir"].weight, layer.lora_B["causal"].weight], dim=1)  # (d_out, 2r)
        h = F.linear(x.to(weight_a.dtype), weight_a)  # (B, T, 2r); inference only: no dropout
        return result + F.linear(h * routing.fit(routing.difference_gate(layer, h), h), weight_b).to(result.dtype)
    if len(names) == 1:
        n = names[0]
        x = x.to(layer.lora_A[n].weight.dtype)
        return (result + layer.lora_B[n](layer.lora_A[n](layer.lora_dropout[n](x))) * layer.scaling[n]).to(result.dtype)
    weight_a = torch.cat([layer.lora_A[n].weight for n in names])  # (sets * r, d_in)
    weight_b = torch.cat([layer.lora_B[n].weight for n in names], dim=1)  # (d_out, sets * r)
    x = layer.lora_dropout[names[0]](x.to(weight_a.dtype))  # one dropout: every set has the same p
    h = F.linear(x, weight_a)  # (B, T, sets * r)
    return result + F.linear(h * routing.fit(routing.gate(layer, h), h), weight_b).to(result.dtype)


@contextmanager
def routed(layers: list[LoraLinear], routing: Routing) -> Iterator[None]:
    """Within this block every layer of ``layers`` computes :func:`routed_lora_forward` with ``routing``.

    The layer's ``forward`` is overridden on the instance and the override removed on exit (PEFT's own state,
    its active adapter and ``requires_grad`` flags, is never changed).
    """
    for layer in layers:
        if layer.merged and layer.merged_adapters != ["causal"]:
            raise ValueError(f"LoRA weights merged as {layer.merged_adapters} cannot be routed per row or position; "
                             "only the causal set may be merged")
    before = [layer.__dict__.get("forward") for layer in layers]  # a merged layer's direct path (merge)
    try:
        for layer in layers:
            layer.forward = _bound(layer, routing)
        yield
    finally:
        for layer, forward in zip(layers, before):
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward


def _bound(layer: LoraLinear, routing: Routing):
    def forward(x, *args, **kwargs):
        return routed_lora_forward(layer, x, routing, *args, **kwargs)
    return forward


class WeightSets(nn.Module):
    """Owns the base model and the weight sets a config asks for; what differs between methods is the method's
    strategy (:data:`bitune.methods.STRATEGIES`).

    Args:
        model: a Hugging Face causal LM (not yet wrapped by PEFT).
        config: the Bitune config; ``config.weight_sets`` says which sets exist, ``config.method`` how.
    """

    def __init__(self, model: nn.Module, config: BituneConfig):
        super().__init__()
        self.method = config.method
        self.strategy = STRATEGIES[config.method]
        self.names = config.weight_sets
        self.bidir_model: nn.Module | None = None
        """A second full model for the bidir set (``method="full"``)."""
        self.tuner_layers: list[BaseTunerLayer] = []
        self.merged = False
        """Whether the causal set is merged into the base weights (inference; see :meth:`merge`)."""
        self.route_ok = True
        """False when a layer sees its tokens in a layout routing cannot follow (:mod:`bitune.support`)."""
        self.bidir_copies: list[tuple[nn.Module, dict[str, torch.Tensor]]] = []
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model  # a variant without weight sets trains nothing
        if self.names:
            self.strategy.create(self, model, config)
        self._lora_layers: list[LoraLinear] = self.strategy.routed_layers(self) if self.names else []

    @property
    def peft(self) -> bool:
        return isinstance(self.model, PeftModel)

    @property
    def base(self) -> nn.Module:
        """The underlying transformers model (with PEFT layers injected, if any)."""
        return self.model.get_base_model() if self.peft else self.model

    def models(self) -> list[nn.Module]:
        """The transformers models the weight sets run: the base (PEFT layers injected), and the full bidir copy."""
        return [self.base] + ([self.bidir_model] if self.bidir_model is not None else [])

    @property
    def routable(self) -> bool:
        """Whether different weight sets can run on different rows or positions of one forward (plain LoRA)."""
        return bool(self._lora_layers) and self.route_ok and not self.bidir_copies

    def can_route(self, names: list[str]) -> bool:
        """Whether one forward can apply these weight sets to different rows or positions (plain LoRA, or one
        set)."""
        return len(set(names)) == 1 or self.routable

    def call(self, name: str, **kwargs):
        """Run the model with weight set ``name`` (``"causal"`` or ``"bidir"``)."""
        if name not in WEIGHT_SETS:
            raise ValueError(f"unknown weight set {name!r}; allowed: {WEIGHT_SETS}")
        if name == "causal" or name not in self.names:
            return self.model(**kwargs)  # the causal weights are always PEFT's active adapter
        if self.routable:
            with recorded(routed, self._lora_layers, Routing([(name, 1)])):
                return self.model(**kwargs)
        return self.strategy.call(self, name, kwargs)

    def call_rows(self, names: list[str], **kwargs):
        """Run one forward whose row r uses weight set ``names[r]``."""
        return self._call_routed(Routing([(name, 1) for name in names], dim=0), kwargs)

    def call_segments(self, segments: list[tuple[str, int]], **kwargs):
        """Run one forward whose input positions are split into ``(weight set, length)`` segments, in order."""
        return self._call_routed(Routing(list(segments), dim=1), kwargs)

    def _call_routed(self, routing: Routing, kwargs):
        inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        routing.batch = tuple(inputs.shape[:2]) if inputs is not None else None
        names = [n if n in self.names else "causal" for n in routing.names]  # a set the variant lacks: causal
        routing.blocks = [(n if n in self.names else "causal", size) for n, size in routing.blocks]
        if len(set(names)) == 1:
            return self.call(names[0], **kwargs)
        if not self.can_route(names):
            raise ValueError(f"method {self.method!r} cannot mix weight sets within one forward")
        with recorded(routed, self._lora_layers, routing):
            return self.model(**kwargs)

    # ----------------------------------------------------------------------------------------- inference
    @torch.no_grad()
    def merge(self, bidir_copy: bool = False) -> None:
        """Merge the causal set into the base weights (in place, PEFT's own merge), for inference: the causal
        prompt pass, the answer pass and every decoding step then run the base projections alone, at the base
        model's cost. The bidir prompt pass runs the merged weights plus the difference to the bidir set:

        - LoRA: ``s_b B_b A_b - s_c B_c A_c``, a rank-2r product of the factors already held (no extra memory;
          :func:`routed_lora_forward`), so the two prompt passes can run as one forward over both row sets.
          With ``bidir_copy``, a merged copy of each weight instead, as for DoRA below: the bidir pass then costs
          exactly the causal one (the base model's), for one more copy of the adapted weights in memory and
          the two prompt passes run one after the other (prefill-heavy serving; ``bitune bench generate``).
        - DoRA, IA3 (whose difference is not low-rank: DoRA re-normalises each column): a merged copy of each
          weight the bidir set touches, swapped in for that pass (memory: one more copy of those weights).
        - ``method: full`` holds two weight copies already, and a variant without adapters has nothing to merge.

        Generation, scoring and every inference path give the unmerged model's numbers to float rounding.
        Gradients need the unmerged factors: a merged model does not train (:meth:`unmerge` first; trainers do
        it). A no-op when merged already, or when there is nothing to merge (``method="full"``, ``pretrained``).
        """
        if self.merged or not self.names:
            return
        self.merged = self.strategy.merge(self, "bidir" in self.names and (bidir_copy or not self.routable))

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge` (PEFT's unmerge: the base weights come back to within float rounding of one add and
        one subtract, so a model that is trained after inference and must match training alone bit for bit is
        never merged). A no-op when not merged."""
        if not self.merged:
            return
        self.strategy.unmerge(self)
        self.merged = False

    def merged_bidir_tensors(self) -> list[torch.Tensor]:
        """The copies of base weights (and biases) with the bidir set merged that a merged DoRA or IA3 model holds
        for its bidir prompt pass (:meth:`merge`); empty otherwise. What merging adds to the model's memory."""
        return [t for _, tensors in self.bidir_copies for t in tensors.values()]

    @torch.no_grad()
    def merged_model(self) -> nn.Module:
        """A standard transformers model (no adapter layers) holding the base weights with the causal set merged:
        a copy, on the device and in the dtype of the weights, with the base model's generation config.

        Raises:
            BituneError: PEFT adapters that are not merged (:meth:`merge` first).
        """
        if self.peft and not self.merged:
            raise BituneError("merged_model() needs the causal set merged: call merge() first")
        adapters = {id(p) for name in self.names for p in self.parameters_of(name).values()}
        state = {}
        for key, tensor in self.base.state_dict(keep_vars=True).items():
            if id(tensor) in adapters or any(part.startswith(("lora_", "ia3_")) for part in key.split(".")):
                continue  # PEFT's own per-layer state (DoRA magnitudes, IA3 vectors)
            state[re.sub(r"(\.base_layer)+\.", ".", key)] = tensor.detach().clone()  # nested wrappers too
        config = copy.deepcopy(self.base.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = type(self.base)(config).to(dtype=next(iter(state.values())).dtype)
        plain.load_state_dict(state, strict=True)
        plain.generation_config = self.base.generation_config
        return plain

    def unreached(self, name: str, output: torch.Tensor) -> list[str]:
        """The parameters of weight set ``name`` (:meth:`parameters_of` names) that train but that no gradient of
        ``output`` (a scalar) reaches."""
        params = {key: p for key, p in self.parameters_of(name).items() if p.requires_grad}
        grads = torch.autograd.grad(output, list(params.values()), allow_unused=True)
        return [key for key, g in zip(params, grads) if g is None]

    def freeze(self, name: str, keys: list[str]) -> None:
        """Stop training these parameters of weight set ``name`` (:meth:`parameters_of` names, e.g. :meth:`unreached`)."""
        params = self.parameters_of(name)
        for key in keys:
            params[key].requires_grad_(False)

    def parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        """Trainable parameters of one weight set, by name (empty if the set does not exist)."""
        if name not in self.names:
            return {}
        return self.strategy.parameters_of(self, name)
