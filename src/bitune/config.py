"""Typed settings of a Bitune model: which variant of the method, which weights it trains and how.

This is what a checkpoint saves. How the passes execute (fused, batched, sequential) is not part of what was
learned: it is a runtime argument of :class:`bitune.model.BituneModel` (``prompt_passes``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import BituneError, did_you_mean
from .files import check_named, read_text

CONFIG_FILE = "bitune_config.json"
PAPER_INIT_SHARE = 0.5
"""The paper's bidirectional share at step 0 (theta = theta_init), pinned by its configs; the library's default
(:data:`DEFAULT_INIT_SHARE`) starts nearer causal."""
DEFAULT_INIT_SHARE = 0.1
"""The default bidirectional share at step 0 (:attr:`BituneConfig.init_share`): the model starts near its causal
self, so a short run does not begin by feeding the decoder mostly untrained bidirectional features."""
RECORDED_DEFAULTS: dict[str, Any] = {"template": "paper", "init_share": PAPER_INIT_SHARE}
"""What a checkpoint or run that does not record a field was made with: the field's value before it was
recorded (``template``) or before its default changed (``init_share``: 0.5 until the default became 0.1)."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32 (``torch.finfo(torch.float32).tiny``): the least start theta that is accepted."""
MAX_INIT_SHARE = 1 - 2 ** -24
"""The largest share whose mixing ratio float32 holds below 1 (the float32 just below 1.0), whatever theta_init: a
share nearer 1 starts at a == 1.0 exactly, where theta gets no gradient."""
"""The file a checkpoint records its :class:`BituneConfig` in."""

VARIANTS: dict[str, str] = {
    "bitune": "causal + bidirectional prompt passes with separate weights, mixed per layer (the method)",
    "naive_bidir": "one weight set, bidirectional prompt pass, no mixing",
    "no_mixing": "bidirectional prompt pass with the bidir weights only; causal weights for the answer",
    "only_causal": "two causal prompt passes with separate weights, mixed",
    "shared_weights": "one weight set for both prompt passes (causal + bidirectional), mixed",
    "anti_causal": "second prompt pass with the transposed causal mask, separate weights, mixed",
    "causal_state": "as bitune, but recurrent and conv layers keep the causal pass's state (a_s = a_c = 0): "
                    "only attention keys and values are mixed (hybrid models)",
    "lora": "baseline: ordinary single-pass causal fine-tuning on prompt + answer",
    "pretrained": "baseline: the base model, nothing trained",
}
METHODS: dict[str, str] = {
    "lora": "LoRA adapters (PEFT)",
    "dora": "weight-decomposed LoRA (PEFT, use_dora=True)",
    "ia3": "IA3 activation scaling (PEFT)",
    "full": "full fine-tuning; Bitune variants keep a second full copy for the bidirectional pass",
}
TEMPLATES: dict[str, str] = {
    "paper": "the paper's 'Question: ...\\n\\nAnswer:' template (tokenized with the tokenizer's special tokens)",
    "chat": "the tokenizer's chat template, answer ended by its end-of-turn token",
    "none": "the prompt text as given",
}
PASS_MASKS = ("causal", "bidirectional", "anti_causal")
PROMPT_PASSES: dict[str, str] = {
    "auto": "the default: fused for a forward, batched for reading a prompt (bitune bench train / generate measure "
            "the choices side by side)",
    "fused": "a forward is one forward over 2T + A positions (both prompt passes and the answer); a prompt read "
             "alone (generation, evaluation) runs both prompt passes as one forward over 2B rows",
    "batched": "both prompt passes as one forward over 2B rows, then the answer pass; a prompt read alone the same",
    "sequential": "one forward per pass, in a forward and in a prompt read alone",
}
"""How the passes may run: a runtime argument of ``BituneModel``, never saved in a config. Each choice makes two
decisions, resolved by ``BituneModel.forward_path`` (a forward: prompt passes and answer pass) and
``BituneModel.prefill_path`` (a prompt read alone). Fused and batched need plain LoRA or one shared weight set;
other methods always run sequentially."""


def merge_choice(no_merge: bool = False, merge_bidir: bool = False) -> bool | str:
    """The ``merge`` of :func:`bitune.loading.load_bitune` from the ``--no-merge`` / ``--merge-bidir`` flags, a runtime
    choice like ``PROMPT_PASSES`` (never saved): ``"both"`` (the bidir weights merged too), ``False`` or ``True``."""
    if merge_bidir:
        return "both"
    return not no_merge


@dataclass
class BituneConfig:
    """How a pretrained causal LM is turned into a Bitune model: what a checkpoint saves.

    Every field is validated on construction; the variant's passes and weight sets are derived from it
    (:attr:`passes`, :attr:`weight_sets`).

    Raises:
        ValueError: a field has an invalid value (the message names the field and the allowed values), or
            ``method`` is not ``"lora"`` for the ``pretrained`` variant, which trains nothing.
    """

    variant: str = "bitune"
    """Which method to run: one of ``VARIANTS`` (the paper's method, its ablations, or a baseline)."""
    method: str = "lora"
    """How weights are trained: one of ``METHODS``."""
    rank: int = 8
    """LoRA / DoRA rank, a positive integer (16 gives the paper's LoRA16 baseline)."""
    lora_alpha: float = 1.0
    """LoRA scaling numerator, > 0; the authors use 1 (scaling 1/rank)."""
    lora_dropout: float = 0.0
    """Dropout probability on the LoRA input, in [0, 1)."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get adapters: PEFT's ``"all-linear"`` (every linear layer of attention and MLP) or a non-empty
    list of module names."""
    theta_init: float = 0.01
    """Scale of the mixing parameters theta, > 0: the mixing ratio is a = |theta| / (theta_init + |theta|)."""
    init_share: float = DEFAULT_INIT_SHARE
    """Bidirectional share a of every layer's keys and values at step 0, in (0, 1), with theta = theta_init * a /
    (1 - a) (:func:`start_theta`): the default 0.1 starts the model near its causal self, so a short run does not
    begin by feeding the decoder mostly untrained bidirectional features; the paper starts at 0.5 (theta =
    theta_init), which its configs pin. A share so near 0 that theta is below float32's normal range, or so near
    1 that a is 1.0 in float32 (either way theta gets no gradient), is refused (:func:`init_share_problem`)."""
    base_model: str | None = None
    """Name or path of the base model, recorded so a checkpoint can reload its base by itself; None: not
    recorded (the base must then be given when loading)."""
    template: str | None = None
    """Prompt template the model was trained with (one of ``TEMPLATES``), recorded by ``bitune train`` from the
    data's format so generate, chat and eval use it by default; none: not recorded (a checkpoint written before
    this field existed was trained with ``"paper"``)."""

    def __post_init__(self) -> None:
        _check_choice("variant", self.variant, VARIANTS)
        _check_choice("method", self.method, METHODS)
        if self.variant == "pretrained" and self.method != "lora":
            raise ValueError("BituneConfig.method: the 'pretrained' variant trains nothing; leave method='lora'")
        if self.template is not None and (not isinstance(self.template, str) or self.template not in TEMPLATES):
            raise ValueError(f"BituneConfig.template={self.template!r} is not one of {list(TEMPLATES)} (or None)")
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"BituneConfig.rank must be a positive integer, got {self.rank!r}")
        for name in ("lora_alpha", "lora_dropout", "theta_init", "init_share"):
            _check_number(name, getattr(self, name))
        if not self.lora_alpha > 0:
            raise ValueError(f"BituneConfig.lora_alpha must be > 0, got {self.lora_alpha!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"BituneConfig.lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if not self.theta_init > 0:
            raise ValueError(f"BituneConfig.theta_init must be > 0, got {self.theta_init!r}")
        problem = init_share_problem(self.init_share, self.theta_init)
        if problem:
            raise ValueError(f"BituneConfig.{problem}")
        if (self.target_modules != "all-linear" if isinstance(self.target_modules, str)
                else not isinstance(self.target_modules, (list, tuple))
                or not all(isinstance(m, str) and m for m in self.target_modules)):
            raise ValueError("BituneConfig.target_modules must be 'all-linear' or a list of module names, "
                             f"got {self.target_modules!r}")
        if not isinstance(self.target_modules, str):
            self.target_modules = list(self.target_modules)
            if not self.target_modules:
                raise ValueError("BituneConfig.target_modules is empty")
        if self.base_model is not None and (not isinstance(self.base_model, str) or not self.base_model.strip()):
            raise ValueError(f"BituneConfig.base_model must be a model name or folder path, got {self.base_model!r}")

    # What the variant does, derived rather than stored.
    @property
    def passes(self) -> tuple[tuple[str, str], ...]:
        """The prompt passes as ``(weights, mask)`` pairs; weights are ``"causal"`` or ``"bidir"``."""
        return {
            "bitune": (("causal", "causal"), ("bidir", "bidirectional")),
            "causal_state": (("causal", "causal"), ("bidir", "bidirectional")),
            "naive_bidir": (("causal", "bidirectional"),),
            "no_mixing": (("bidir", "bidirectional"),),
            "only_causal": (("causal", "causal"), ("bidir", "causal")),
            "shared_weights": (("causal", "causal"), ("causal", "bidirectional")),
            "anti_causal": (("causal", "causal"), ("bidir", "anti_causal")),
            "lora": (("causal", "causal"),),
            "pretrained": (("causal", "causal"),),
        }[self.variant]

    @property
    def mixes(self) -> bool:
        """Whether two prompt passes are mixed with learnable coefficients."""
        return len(self.passes) == 2

    @property
    def mixes_states(self) -> bool:
        """Whether recurrent and conv layers' states are mixed too (every mixing variant but ``causal_state``)."""
        return self.mixes and self.variant != "causal_state"

    @property
    def weight_sets(self) -> tuple[str, ...]:
        """The trained weight sets (empty for ``pretrained``)."""
        if self.variant == "pretrained":
            return ()
        return tuple(dict.fromkeys(["causal", *(w for w, _ in self.passes)]))

    @property
    def single_pass(self) -> bool:
        """Whether prompt and answer form one ordinary causal sequence (the baselines)."""
        return self.variant in ("lora", "pretrained")

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict, the inverse of :meth:`from_dict`."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """The fields as indented JSON with sorted keys: the ``bitune_config.json`` of a checkpoint."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BituneConfig:
        """Build from a dict (as :meth:`to_dict` writes it), rejecting unknown keys by name.

        Args:
            data: field names and values; missing fields take their defaults.

        Returns:
            The validated config.

        Raises:
            ValueError: ``data`` has a key that is not a field, or a field has an invalid value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"BituneConfig: unknown key(s) {unknown}; allowed: {sorted(known)}")
        return cls(**data)


def start_theta(init_share: float, theta_init: float) -> float:
    """The mixer's theta at step 0 for the bidirectional share ``init_share``: theta_init * a / (1 - a), so that
    a = |theta| / (theta_init + |theta|) = ``init_share`` (theta_init itself at the paper's 0.5)."""
    return theta_init if init_share == PAPER_INIT_SHARE else theta_init * init_share / (1.0 - init_share)


def init_share_problem(init_share: Any, theta_init: float) -> str | None:
    """What makes ``init_share`` no start for the mixer with ``theta_init``, or None: the one check of the share,
    wherever one is given or read (:class:`BituneConfig`, :class:`bitune.mixer.Mixer`, a run's settings in
    :mod:`bitune.plot`). A share is a number in (0, 1) whose mixing ratio can move: its start theta is a normal
    float32 (below that, theta is 0 and gets no gradient) and its ratio a, computed in float32 as the mixer does,
    is below 1.0 (at 1.0, ``init_share`` > :data:`MAX_INIT_SHARE`, the gradient is 0).

    Returns:
        ``"init_share=... is ...; use ..."``, naming the value and the usable range, for the caller to prefix.
    """
    low = FLOAT32_TINY * (1.0 + 1e-12) / theta_init  # the least share whose theta float32 holds as a normal number
    usable = f"use a share in [{low:.1g}, {MAX_INIT_SHARE:.8g}] with theta_init={theta_init:g}"
    if isinstance(init_share, bool) or not isinstance(init_share, (int, float)) or not 0.0 < init_share < 1.0:
        return (f"init_share={init_share!r} is not a share in (0, 1) (the bidirectional share at step 0; the "
                f"paper's {PAPER_INIT_SHARE}); {usable}")
    start = start_theta(init_share, theta_init)
    if start < FLOAT32_TINY:
        return (f"init_share={init_share!r} is too small: theta starts at theta_init * a / (1 - a) = {start:.3g}, "
                f"which float32 cannot hold as a normal number (below {FLOAT32_TINY:.3g}; at 0 |theta| gets no "
                f"gradient and the share stays 0); {usable}")
    if _float32_ratio(start, theta_init) >= 1.0:
        return (f"init_share={init_share!r} is too close to 1: theta starts at {start:.3g} and the mixing ratio a = "
                f"|theta| / (theta_init + |theta|) is 1.0 in float32, where theta gets no gradient and the share "
                f"stays 1; {usable}")
    return None


def _float32_ratio(theta: float, theta_init: float) -> float:
    """a = theta / (theta_init + theta) as the mixer computes it, in float32 (each operation rounded to float32;
    a theta beyond float32's range is 1.0)."""
    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    try:
        t = f32(theta)
        return f32(t / f32(f32(theta_init) + t))
    except OverflowError:
        return 1.0


def _check_number(name: str, value: Any) -> None:
    """A finite real number (a bool is not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"BituneConfig.{name} must be a finite number, got {value!r}")


def _check_choice(name: str, value: Any, allowed: dict[str, str]) -> None:
    if not isinstance(value, str) or value not in allowed:
        hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
        raise ValueError(f"BituneConfig.{name}={value!r} is not one of {sorted(allowed)}{hint}")


def read_config(directory: str | os.PathLike) -> BituneConfig:
    """The :class:`BituneConfig` a checkpoint folder records.

    Older checkpoints still load: a field they do not record takes :data:`RECORDED_DEFAULTS` (one written before
    templates were recorded was trained with ``paper``, one written before ``init_share`` was recorded started at
    the paper's 0.5); one written while ``prompt_passes`` was a saved setting carries it, and it is ignored (a
    runtime choice now).
    """
    directory = Path(check_named(directory, "the checkpoint folder"))
    path = directory / CONFIG_FILE
    if not path.is_file():
        if not directory.exists():
            raise BituneError(f"{directory} is not a Bitune checkpoint: no such folder")
        if not directory.is_dir():
            raise BituneError(f"{directory} is not a Bitune checkpoint: it is a file, not a folder")
        inner = [p.parent for p in directory.glob(f"*/{CONFIG_FILE}")]  # a run folder: final/, checkpoint-N/
        step = {p: p.name.rpartition("-")[2] for p in inner}
        newest = max(inner, key=lambda p: (p.name == "final", int(step[p]) if step[p].isdigit() else -1),
                     default=None)
        hint = f"; did you mean {newest}, the checkpoint in it?" if newest else ""
        raise BituneError(f"{directory} is not a Bitune checkpoint: {CONFIG_FILE} is missing{hint}")
    try:
        data = json.loads(read_text(path, "Bitune config"))
        if isinstance(data, dict):
            data = {**RECORDED_DEFAULTS, **data}
            data.pop("prompt_passes", None)
        return BituneConfig.from_dict(data)
    except BituneError:
        raise
    except (ValueError, TypeError) as e:  # bad JSON, not an object, unknown keys, a field of the wrong type or value
        raise ValueError(f"{path} is not a valid Bitune config: {e}") from e


__all__ = ["BituneConfig", "PAPER_INIT_SHARE", "RECORDED_DEFAULTS", "VARIANTS", "METHODS", "PASS_MASKS", "TEMPLATES",
           "PROMPT_PASSES", "CONFIG_FILE", "read_config"]
