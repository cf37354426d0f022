"""How each training method (``BituneConfig.method``) keeps, trains and merges the two weight sets.

One strategy object per method, in the manner of PEFT's ``LoraVariant``: stateless methods that receive the
:class:`bitune.adapters.WeightSets` holding the state (PEFT's receive the LoRA layer), chosen from
:data:`STRATEGIES` by method name. A new method is one class and one entry of that table.

- **LoRA, DoRA, IA3** keep both sets as named adapters of one PeftModel, in PEFT's own format; the causal adapter
  is PEFT's active adapter at all times, so a plain forward (and transformers' ``generate``) runs the causal
  weights. Plain LoRA can run different sets on different rows or positions of one forward
  (:func:`bitune.adapters.routed`); DoRA and IA3 cannot, and their bidir passes switch PEFT's active adapter with
  its public ``set_adapter`` (:func:`switched_to`), or, merged, swap in a merged copy of each weight
  (:func:`swapped_in`).
- **Full fine-tuning** keeps the model's own weights as the causal set and a second full copy as the bidir set.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from peft import IA3Config, LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from .config import BituneConfig
from .recompute import recorded


class Sets(Protocol):
    """What a strategy reads and sets on the :class:`bitune.adapters.WeightSets` it serves."""

    model: nn.Module
    """The model whose plain forward runs the causal set (a PeftModel for the PEFT methods)."""
    bidir_model: nn.Module | None
    """A second full model for the bidir set (``method="full"``), else None."""
    tuner_layers: list[BaseTunerLayer]
    """PEFT's layers of both sets, in model order (empty without PEFT)."""
    merged: bool
    """Whether the causal set is merged into the base weights."""
    bidir_copies: list[tuple[nn.Module, dict[str, torch.Tensor]]]
    """Merged copies of the weights the bidir set touches, swapped in for its pass (:func:`merged_copy`)."""


class Method:
    """What one training method does with the weight sets; every method receives the sets it serves (:class:`Sets`)."""

    @staticmethod
    def create(sets: Sets, model: nn.Module, config: BituneConfig) -> None:
        """Add ``config.weight_sets`` (not empty) to ``model``, whose parameters arrive frozen: set ``sets.model``
        (whose plain forward runs the causal set) and whatever else the method keeps, and make trainable exactly
        the parameters the sets train."""
        raise NotImplementedError

    @staticmethod
    def parameters_of(sets: Sets, name: str) -> dict[str, nn.Parameter]:
        """The parameters weight set ``name`` (one the sets hold) trains, by name."""
        raise NotImplementedError

    @staticmethod
    def routed_layers(sets: Sets) -> list[LoraLinear]:
        """The layers a per-row or per-position routing runs through (:func:`bitune.adapters.routed`); empty when
        the method cannot run different sets in one forward."""
        return []

    @staticmethod
    def call(sets: Sets, name: str, kwargs: dict):
        """One forward with the bidir set ``name``, without routing."""
        raise NotImplementedError

    @staticmethod
    def merge(sets: Sets, copy_bidir: bool) -> bool:
        """Merge the causal set into the base weights for inference (:meth:`bitune.adapters.WeightSets.merge`);
        with ``copy_bidir``, also keep a merged copy of each weight the bidir set touches (``sets.bidir_copies``).
        Returns whether anything was merged."""
        raise NotImplementedError

    @staticmethod
    def unmerge(sets: Sets) -> None:
        """Undo :meth:`merge`."""


class Full(Method):
    """Full fine-tuning: the model's own floating-point weights are the causal set, a full copy the bidir set."""

    @staticmethod
    def create(sets, model, config):
        for p in model.parameters():
            p.requires_grad_(p.is_floating_point())
        sets.model = model
        if "bidir" in config.weight_sets:
            sets.bidir_model = copy.deepcopy(model)  # the same weights to start, trained apart

    @staticmethod
    def parameters_of(sets, name):
        model = sets.bidir_model if name == "bidir" else sets.model
        return {k: p for k, p in model.named_parameters() if p.is_floating_point()}

    @staticmethod
    def call(sets, name, kwargs):
        return sets.bidir_model(**kwargs)

    @staticmethod
    def merge(sets, copy_bidir):
        return False  # two weight copies already: nothing to merge


FUSED_EXPERT_PATTERNS = (r"The following (rank|alpha)_pattern keys did not match any targeted module and were "
                         r"ignored: " + re.escape(repr([r".*\.gate_up_proj"])))
"""PEFT's warning about the rank and alpha patterns its transformers v4 -> v5 conversion adds for MoE experts whose
gate and up projections are fused into one 3-D parameter (mixtral, qwen2_moe and kin: rank 2r and alpha 2 alpha,
the config's scaling). The patterns apply, but PEFT's check looks for them among module names only, and the
experts are a parameter, so it warns that they matched nothing. Known harmless; silenced exactly."""


@contextmanager
def peft_quiet() -> Iterator[None]:
    """Silence exactly the PEFT warnings known to be harmless here: a property transformers 5 deprecated that PEFT
    reads, and :data:`FUSED_EXPERT_PATTERNS`."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        warnings.filterwarnings("ignore", message=FUSED_EXPERT_PATTERNS, category=RuntimeWarning)
        yield


class PeftMethod(Method):
    """A method whose weight sets are two named adapters ("causal", "bidir") of one PeftModel."""

    @staticmethod
    def peft_config(config: BituneConfig, model: nn.Module):
        """PEFT's config for one adapter of this method."""
        raise NotImplementedError

    @classmethod
    def create(cls, sets, model, config):
        if isinstance(model, PeftModel):
            raise ValueError("wrap() expects a plain transformers model, not a PeftModel: "
                             "Bitune adds its own adapters")
        peft_config = cls.peft_config(config, model)
        try:
            with peft_quiet():
                sets.model = get_peft_model(model, peft_config, adapter_name="causal")
        except (ValueError, KeyError) as e:
            raise ValueError(f"PEFT cannot add {config.method} adapters to this model "
                             f"({type(model).__name__}): {e}") from e
        if "bidir" in config.weight_sets:
            with peft_quiet():
                sets.model.add_adapter("bidir", peft_config)
        sets.model.set_adapter("causal")  # the causal weights are what a plain forward runs
        sets.model.set_requires_grad(list(config.weight_sets), True)  # set_adapter froze the other adapter
        sets.tuner_layers = [m for m in sets.model.modules() if isinstance(m, BaseTunerLayer)]

    @staticmethod
    def parameters_of(sets, name):
        owned = set()
        for layer in sets.tuner_layers:
            for attr in layer.adapter_layer_names:
                store = getattr(layer, attr)
                entry = store[name] if name in store else None
                if isinstance(entry, nn.Parameter):
                    owned.add(id(entry))
                elif entry is not None:
                    owned.update(id(p) for p in entry.parameters())
        return {k: p for k, p in sets.model.named_parameters() if id(p) in owned}

    @staticmethod
    def call(sets, name, kwargs):
        if sets.merged:
            with swapped_in(sets.bidir_copies):
                return sets.model(**kwargs)
        with recorded(switched_to, sets.model, name):
            return sets.model(**kwargs)

    @staticmethod
    def merge(sets, copy_bidir):
        if copy_bidir:
            sets.bidir_copies = [merged_copy(layer, "bidir") for layer in sets.tuner_layers]
        for layer in sets.tuner_layers:
            layer.merge(adapter_names=["causal"])
            # PEFT's forward of a merged layer only calls its base layer, after checks and bookkeeping that cost
            # a decoding step a few percent on a small model; the merged layer calls it directly instead (the
            # base layer's own __call__, so hooks on it still run). unmerge() and routed() put PEFT's back.
            layer.forward = layer.base_layer.__call__
        return True

    @staticmethod
    def unmerge(sets):
        for layer in sets.tuner_layers:
            layer.__dict__.pop("forward", None)
            layer.unmerge()
        sets.bidir_copies = []


class Lora(PeftMethod):
    """LoRA: the only method whose sets can share one forward, row by row or position by position."""

    @staticmethod
    def peft_config(config, model):
        return lora_config(config, model, dora=False)

    @staticmethod
    def routed_layers(sets):
        layers = sets.tuner_layers
        return list(layers) if layers and all(isinstance(m, LoraLinear) for m in layers) else []


class Dora(PeftMethod):
    """Weight-decomposed LoRA: its difference between the sets is not low-rank (each column is re-normalised)."""

    @staticmethod
    def peft_config(config, model):
        return lora_config(config, model, dora=True)


class IA3(PeftMethod):
    """IA3: learned scaling vectors on activations."""

    @staticmethod
    def peft_config(config, model):
        if config.target_modules == "all-linear":
            return IA3Config()  # PEFT's per-architecture defaults (attention k/v and the MLP down projection)
        return IA3Config(target_modules=config.target_modules, feedforward_modules=[])


STRATEGIES: dict[str, Method] = {"lora": Lora(), "dora": Dora(), "ia3": IA3(), "full": Full()}
"""The strategy of each method of ``bitune.config.METHODS``, by name."""


def lora_config(config: BituneConfig, model: nn.Module, dora: bool) -> LoraConfig:
    """PEFT's ``LoraConfig`` for ``config``'s rank, scaling, dropout and target modules (DoRA with ``dora``)."""
    exclude = tuple_linears(model) + mamba_excluded(model) if config.target_modules == "all-linear" else []
    return LoraConfig(
        r=config.rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
        target_modules=config.target_modules, use_dora=dora, bias="none",
        **({"exclude_modules": exclude} if exclude else {}),
    )


MAMBA_EXCLUDED = ("out_proj", "conv1d")
"""Module names PEFT 0.21 refuses to adapt with LoRA in the model types of :data:`MAMBA_TYPES`
(``peft.tuners.tuners_utils._check_lora_target_modules_mamba``): ``all-linear`` leaves them out there."""
MAMBA_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")


def mamba_excluded(model: nn.Module) -> list[str]:
    """The modules of a Mamba-based ``model`` that PEFT's LoRA refuses (:data:`MAMBA_EXCLUDED`); none elsewhere."""
    if getattr(getattr(model, "config", None), "model_type", None) not in MAMBA_TYPES:
        return []
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] in MAMBA_EXCLUDED]


def tuple_linears(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that subclass ``nn.Linear`` with a forward of their own that does not
    return a tensor (MoE routers that return scores and expert indices: Llama 4, PhiMoE). PEFT's ``all-linear``
    would adapt them as plain linear layers and add its update to whatever they return; ``all-linear`` leaves
    them out. Each candidate is called on a zero input ((1, 1, d), else (4, d) tokens)."""
    names = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or type(m).forward is nn.Linear.forward:
            continue
        for shape in ((1, 1, m.in_features), (4, m.in_features)):  # tokens as (B, T, d) or flattened
            try:
                with torch.no_grad():
                    out = m(torch.zeros(shape, dtype=m.weight.dtype, device=m.weight.device))
            except Exception:  # noqa: BLE001, S112 - a forward that needs more: the next shape, else PEFT decides
                continue
            if not isinstance(out, torch.Tensor):
                names.append(name)
            break
    return names


def merged_copy(layer: BaseTunerLayer, name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tensors of ``layer``'s base module that set ``name`` adapts, merged (computed by PEFT's own merge on
    the layer, whatever it adapts: a linear weight and bias, or one fused 3-D expert parameter of a mixture of
    experts), after which the original tensors are put back exactly (not un-merged)."""
    base = layer.get_base_layer()
    names = ([layer.parameter_name] if hasattr(layer, "parameter_name")  # a wrapped 3-D expert parameter
             else [k for k in ("weight", "bias") if isinstance(getattr(base, k, None), torch.Tensor)])
    before = {k: getattr(base, k).data.clone() for k in names}
    layer.merge(adapter_names=[name])
    merged = {}
    for k in names:
        param = getattr(base, k)
        merged[k], param.data = param.data, before[k]
    layer.merged_adapters.remove(name)
    return base, merged


@contextmanager
def swapped_in(copies: list[tuple[nn.Module, dict[str, torch.Tensor]]]) -> Iterator[None]:
    """Within this block the base modules hold the bidir-merged tensors of ``copies`` (from :func:`merged_copy`:
    DoRA, IA3, or layers that cannot be routed, on a merged model)."""
    def swap():
        for base, tensors in copies:
            for k, held in tensors.items():
                param = getattr(base, k)
                tensors[k], param.data = param.data, held
    swap()
    try:
        yield
    finally:
        swap()


@contextmanager
def switched_to(model: PeftModel, name: str) -> Iterator[None]:
    """PEFT's active adapter is ``name`` within this block (DoRA, IA3: layers that cannot be routed).

    PEFT's public ``set_adapter`` also sets ``requires_grad`` (only the active adapter trainable); every flag is
    put back afterwards, so both sets stay trainable and bidir weights frozen at wrap time stay frozen.
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.set_adapter(name)
    try:
        yield
    finally:
        model.set_adapter("causal")
        for p, flag in flags:
            p.requires_grad_(flag)
