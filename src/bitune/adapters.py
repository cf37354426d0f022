"""The two weight sets of a Bitune model ("causal" and "bidir") on one Hugging Face model.

PEFT methods (LoRA, DoRA, IA3) keep both sets as named adapters of one PeftModel and switch the active one
per pass without touching ``requires_grad`` (PEFT's ``set_adapter`` would freeze the inactive adapter and
silently drop its gradient). Full fine-tuning keeps the model's own weights as the causal set and a second
full copy, applied with ``torch.func.functional_call``, as the bidir set. This is the only module that
touches PEFT internals.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .config import BituneConfig

WEIGHT_SETS = ("causal", "bidir")


def _peft_config(config: BituneConfig, model: nn.Module):
    if config.method in ("lora", "dora"):
        return LoraConfig(
            r=config.rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
            target_modules=config.target_modules, use_dora=config.method == "dora", bias="none",
        )
    if config.target_modules == "all-linear":
        return IA3Config()  # PEFT's per-architecture defaults (attention k/v and the MLP down projection)
    return IA3Config(target_modules=config.target_modules, feedforward_modules=[])


class WeightSets(nn.Module):
    """Owns the base model and the weight sets a config asks for.

    Args:
        model: a Hugging Face causal LM (not yet wrapped by PEFT).
        config: the Bitune config; ``config.weight_sets`` says which sets exist.
    """

    def __init__(self, model: nn.Module, config: BituneConfig):
        super().__init__()
        self.method = config.method
        self.names = config.weight_sets
        self.bidir = nn.ParameterDict()
        for p in model.parameters():
            p.requires_grad_(False)
        if not self.names or config.method == "full":
            self.model = model
            if config.method == "full" and self.names:
                for p in model.parameters():
                    p.requires_grad_(p.is_floating_point())
                if "bidir" in self.names:
                    for name, p in model.named_parameters():
                        if p.is_floating_point():
                            self.bidir[name.replace(".", "__")] = nn.Parameter(p.detach().clone())
            return
        if isinstance(model, PeftModel):
            raise ValueError("wrap() expects a plain transformers model, not a PeftModel: "
                             "Bitune adds its own adapters")
        peft_config = _peft_config(config, model)
        try:
            with warnings.catch_warnings():  # PEFT reads a property transformers 5 deprecated
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
                self.model = get_peft_model(model, peft_config, adapter_name="causal")
        except (ValueError, KeyError) as e:
            raise ValueError(f"PEFT cannot add {config.method} adapters to this model "
                             f"({type(model).__name__}): {e}") from e
        if "bidir" in self.names:
            self.model.add_adapter("bidir", peft_config)
        self.model.base_model.set_requires_grad(list(self.names), True)
        self._tuner_layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        self._use_adapter("causal")

    @property
    def peft(self) -> bool:
        return isinstance(self.model, PeftModel)

    @property
    def base(self) -> nn.Module:
        """The underlying transformers model (with PEFT layers injected, if any)."""
        return self.model.get_base_model() if self.peft else self.model

    def can_route_rows(self, names: list[str]) -> bool:
        """Whether one forward can apply different weight sets to different rows or positions (plain LoRA,
        or one set)."""
        return len(set(names)) == 1 or (self.method == "lora" and self.peft and all(
            isinstance(layer, LoraLinear) for layer in self._tuner_layers))

    def call_rows(self, names: list[str], **kwargs):
        """Run one forward whose row r uses weight set ``names[r]``."""
        return self._call_routed([(name, 1) for name in names], 0, kwargs)

    def call_segments(self, segments: list[tuple[str, int]], **kwargs):
        """Run one forward whose input positions are split into ``(weight set, length)`` segments, in order."""
        return self._call_routed(segments, 1, kwargs)

    def _call_routed(self, blocks: list[tuple[str, int]], dim: int, kwargs):
        """One forward where each block of rows (dim 0) or positions (dim 1) uses its own weight set.

        Each LoRA layer computes its frozen base projection once over everything, then all sets' low-rank
        updates in two matrix products over everything: ``x [A_1; A_2]^T`` is gated so that each block keeps
        only its own set's r columns (times that set's scaling), then multiplied by ``[B_1, B_2]``. That costs
        as many operations as one adapter, with gradients to every set.
        """
        merged: list[tuple[str, int]] = []  # neighbouring blocks of one weight set become one
        for name, size in blocks:
            if merged and merged[-1][0] == name:
                merged[-1] = (name, merged[-1][1] + size)
            else:
                merged.append((name, size))
        names = list(dict.fromkeys(name for name, _ in merged))
        if len(names) == 1:
            return self.call(names[0], **kwargs)
        if not self.can_route_rows(names):
            raise ValueError(f"method {self.method!r} cannot mix weight sets within one forward")
        gates: dict[tuple, torch.Tensor] = {}

        def gate(layer, like: torch.Tensor) -> torch.Tensor:
            """(rows or positions, 1, sets * r) or (positions, sets * r): each block's scaling on its own set."""
            ranks = tuple(layer.r[n] for n in names)
            scales = tuple(layer.scaling[n] for n in names)
            key = (ranks, scales, like.dtype, like.device)
            if key not in gates:
                cols = torch.tensor([i for i, r in enumerate(ranks) for _ in range(r)], device=like.device)
                owner = torch.tensor([names.index(n) for n, size in merged for _ in range(size)], device=like.device)
                scale = torch.tensor([scales[i] for i in cols.tolist()], dtype=like.dtype, device=like.device)
                g = (owner[:, None] == cols[None, :]).to(like.dtype) * scale  # (N, sets * r)
                gates[key] = g[:, None, :] if dim == 0 else g
            return gates[key]

        def add_updates(layer, args, output):
            weight_a = torch.cat([layer.lora_A[n].weight for n in names])  # (sets * r, d_in)
            weight_b = torch.cat([layer.lora_B[n].weight for n in names], dim=1)  # (d_out, sets * r)
            x = layer.lora_dropout[names[0]](args[0].to(weight_a.dtype))  # one dropout (all sets share p)
            h = F.linear(x, weight_a)  # (..., sets * r)
            return output + F.linear(h * gate(layer, h), weight_b).to(output.dtype)

        lora_layers = [layer for layer in self._tuner_layers if isinstance(layer, LoraLayer)]
        handles = [layer.register_forward_hook(add_updates) for layer in lora_layers]
        for layer in lora_layers:
            layer._active_adapter = []  # the layer itself computes the base projection only
        try:
            return self.model(**kwargs)
        finally:
            for h in handles:
                h.remove()
            self._use_adapter("causal")

    def _use_adapter(self, name: str) -> None:
        for layer in self._tuner_layers:
            layer._active_adapter = [name]

    def parameters_of(self, name: str) -> dict[str, nn.Parameter]:
        """Trainable parameters of one weight set, by name (empty if the set does not exist)."""
        if name not in self.names:
            return {}
        if self.method == "full":
            if name == "bidir":
                return {k.replace("__", "."): p for k, p in self.bidir.items()}
            return {k: p for k, p in self.model.named_parameters() if p.is_floating_point()}
        owned = set()
        for layer in self._tuner_layers:
            for attr in layer.adapter_layer_names:
                store = getattr(layer, attr)
                entry = store[name] if name in store else None
                if isinstance(entry, nn.Parameter):
                    owned.add(id(entry))
                elif entry is not None:
                    owned.update(id(p) for p in entry.parameters())
        return {k: p for k, p in self.model.named_parameters() if id(p) in owned}

    def call(self, name: str, **kwargs):
        """Run the model with weight set ``name`` (``"causal"`` or ``"bidir"``)."""
        if name not in WEIGHT_SETS:
            raise ValueError(f"unknown weight set {name!r}; allowed: {WEIGHT_SETS}")
        if name == "bidir" and self.method == "full":
            params = {k.replace("__", "."): p for k, p in self.bidir.items()}
            return torch.func.functional_call(self.model, params, args=(), kwargs=kwargs, strict=False)
        if self.peft:
            self._use_adapter(name if name in self.names else "causal")
            try:
                return self.model(**kwargs)
            finally:
                self._use_adapter("causal")
        return self.model(**kwargs)
