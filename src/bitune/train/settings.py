"""Typed settings of a training run, loaded from YAML plus ``--set key=value`` overrides.

A config file is a mapping of :class:`TrainSettings` fields; the Bitune model settings form the nested
``bitune:`` section (:class:`bitune.config.BituneConfig`). A file may name another file to extend with
``extends: base.yaml`` (resolved relative to itself, else as a packaged config's name); its sections are merged
key by key. Every key is checked: a typo is rejected with the allowed keys and the closest match (a model setting
given at the top level, with its ``bitune.`` name).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import PROMPT_PASSES, BituneConfig
from ..config_files import resolve_config, resolve_extends
from ..data import datasets
from ..errors import BituneError, did_you_mean
from ..files import read_text
from ..hub import DEFAULT_MODEL

EXTENDS_KEY = "extends"
RUNTIME_KEYS = ("prompt_passes",)
"""Keys an older ``bitune:`` section carried that are runtime choices of the run, not model settings: still
accepted there, and moved to the top level (:func:`upgrade`)."""
BF16_CHOICES = ("auto", "true", "false")
CLIP_CHOICES = ("all", "adapters")
RENAMED_KEYS = {"gradient_checkpointing": "recompute"}
"""Settings read under an older name (still accepted, with a deprecation warning): old name -> new name."""


@dataclass
class TrainSettings:
    """Everything a training run needs; validated on construction."""

    model: str = DEFAULT_MODEL
    """Base model: a built-in offline name (see ``bitune.hub.list_models``), a hub id or a local folder."""
    dataset: str = "alpaca_demo"
    """Training data: a name from ``bitune.data.datasets.DATASETS`` or a local .json/.jsonl file."""
    train_split: str = "train"
    """Split of ``dataset`` to train on."""
    eval_split: str | None = None
    """Split to compute the validation loss on every ``eval_every`` steps (none: no validation)."""
    limit: int | None = None
    """Use only the first N training examples (none: all)."""
    eval_limit: int | None = 200
    """Use only the first N validation examples (none: all)."""
    max_length: int = 512
    """Longest prompt + answer in tokens; longer samples are dropped (not truncated) and counted."""
    bitune: BituneConfig = field(default_factory=BituneConfig)
    """The model variant and how it is trained (section ``bitune:``; see ``BituneConfig``)."""
    lr: float = 3e-4
    """Peak learning rate of AdamW (betas 0.9, 0.999); the paper uses 3e-4 for instructions, 1e-3 for tasks."""
    steps: int | None = None
    """Optimizer steps to train for; overrides ``epochs`` when set."""
    epochs: float = 1.0
    """Passes over the training data (used when ``steps`` is not set)."""
    data_steps: int | None = None
    """Train only on the examples of the first N optimizer steps of the (seed-determined) order, then repeat
    those batches in the same order: ``steps`` > N gives more steps on the same data, not new data (none: all
    the data). A run with ``data_steps: N`` takes the same first N batches as a run without it."""
    batch_size: int = 1
    """Examples per forward pass and process; the loss weighs every example the same (mean of per-example
    answer-token means), so N processes x batch b train like one process with batch N x b."""
    grad_accum: int = 10
    """Forward passes accumulated per optimizer step (global batch = processes x batch_size x grad_accum)."""
    warmup_ratio: float = 0.1
    """Fraction of the steps spent warming the learning rate up linearly from 0; it then decays linearly to 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the gradient to this global norm (0: no clipping)."""
    clip: str = "all"
    """What max_grad_norm clips: 'all' trainable parameters as one vector (the authors' setting) or only the
    'adapters' (the mixer's thetas, whose gradient is far larger, are then left unclipped)."""
    group_by_length: bool | None = None
    """Draw batches of similar prompt and answer lengths (less padding; seed-determined, resumable);
    none: on when batch_size > 1."""
    seed: int = 42
    """Seed of weights init, data order and dropout."""
    bf16: str = "auto"
    """bfloat16 autocast: 'auto' (on where the GPU supports it), 'true' or 'false'; always fp32 on CPU."""
    recompute: bool = False
    """Recompute each decoder layer's activations in the backward pass (activation checkpointing per layer: less
    memory, each layer runs its forward twice); the prompt caches are kept, loss and gradients unchanged. The
    older name ``gradient_checkpointing`` is still read, with a deprecation warning."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over the processes with FSDP2 (each decoder layer, then
    the rest) instead of replicating them (DDP); also set by ``--fsdp`` or an accelerate config with
    ``fsdp_version: 2``."""
    log_every: int = 10
    """Log loss, learning rate and mixing ratios every N steps (log.jsonl and TensorBoard)."""
    eval_every: int | None = None
    """Compute the validation loss every N steps (needs ``eval_split``; none: only at the end)."""
    save_every: int | None = None
    """Write a resumable checkpoint every N steps (none: only the final model)."""
    save_total_limit: int | None = 2
    """Keep only the newest N checkpoints (none: keep all)."""
    output_dir: str = "runs/{dataset}/{variant}-{method}-s{seed}"
    """Folder for checkpoints, ``final/``, logs and settings; may use {dataset} {variant} {method} {rank}
    {theta_init} {seed}."""
    num_workers: int = 0
    """Data loader worker processes."""
    prompt_passes: str = "auto"
    """How the passes run: one of ``bitune.config.PROMPT_PASSES`` (a runtime choice: every choice trains the same
    numbers, it is not saved in the checkpoint and a resumed run may change it; ``bitune.prompt_passes`` is still
    read)."""

    def __post_init__(self) -> None:
        if isinstance(self.bitune, dict):
            self.bitune = _bitune_config(self.bitune)
        if not isinstance(self.bitune, BituneConfig):
            raise BituneError(f"bitune: expected a mapping of BituneConfig fields, got {self.bitune!r}")
        for f in dataclasses.fields(self):
            if f.name != "bitune":
                setattr(self, f.name, _coerce(f"{f.name}", getattr(self, f.name), _hints()[f.name]))
        self.bf16 = str(self.bf16).lower()
        for name, check, message in CHECKS:
            value = getattr(self, name)
            if value is not None and not check(value):
                raise BituneError(message.format(name=name, value=value))
        if self.eval_every is not None and self.eval_split is None:
            raise BituneError("eval_every is set but eval_split is not: name the split to validate on")
        if self.bitune.base_model is not None and self.bitune.base_model != self.model:
            raise BituneError(f"bitune.base_model={self.bitune.base_model!r} differs from model={self.model!r}; "
                              "leave bitune.base_model unset (it is filled in from model)")
        if self.bitune.template is not None:
            raise BituneError(f"bitune.template={self.bitune.template!r}: the template is recorded from the dataset's "
                              "format (paper for named datasets; a file's rows decide); leave it unset")
        self.output_dir = self._fill(self.output_dir)


    def check_dataset(self) -> None:
        """Reject an unknown dataset name or split, or a malformed local file, before anything runs."""
        if self.dataset not in datasets.DATASETS and not self.dataset.endswith((".json", ".jsonl")):
            raise BituneError(f"dataset={self.dataset!r}{did_you_mean(self.dataset, datasets.DATASETS)} is not one "
                              f"of {', '.join(datasets.DATASETS)} nor a .json/.jsonl file")
        if self.dataset not in datasets.DATASETS:  # a local file: every row parsed and checked now (errors name row, field)
            for split in {self.train_split, self.eval_split} - {None}:
                datasets.load_examples(self.dataset, split)
        info = datasets.DATASETS.get(self.dataset)
        for field_name in ("train_split", "eval_split"):
            split = getattr(self, field_name)
            if info is not None and split is not None and split not in info.splits:
                raise BituneError(f"{field_name}={split!r}: dataset {self.dataset} has splits "
                                  f"{', '.join(info.splits)}")

    def _fill(self, template: str) -> str:
        names = {"dataset": Path(self.dataset).stem, "variant": self.bitune.variant, "method": self.bitune.method,
                 "rank": self.bitune.rank, "theta_init": self.bitune.theta_init, "seed": self.seed}
        try:
            return template.format_map(names)
        except (KeyError, ValueError, IndexError) as e:
            raise BituneError(f"output_dir={template!r}: bad placeholder {e}; allowed: "
                              f"{', '.join('{' + k + '}' for k in names)}") from e

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-ready) of every setting."""
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainSettings:
        """Build from a (nested) dict, rejecting unknown keys with the closest allowed one."""
        if not isinstance(data, dict):
            raise BituneError(f"settings must be a mapping of keys to values, got {type(data).__name__}")
        given = {new: old for old, new in RENAMED_KEYS.items() if old in data and new not in data}
        data = upgrade(data)
        _check_keys(data, field_names(cls), "")
        try:
            return cls(**data)
        except BituneError as e:  # name the key the user wrote, not the one it was read as
            new = next((new for new in given if str(e).startswith(f"{new}=")), None)
            if new is None:
                raise
            raise BituneError(f"{given[new]}{str(e)[len(new):]} ({given[new]} is the older name of {new})") from e


def upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Settings as this version lays them out: a renamed key (:data:`RENAMED_KEYS`) takes its new name, with a
    ``DeprecationWarning``; a ``bitune.prompt_passes`` (once a model setting) moves to the top level, where the
    run's runtime choices live. A copy, ``data`` is left as it is.

    Raises:
        BituneError: a setting is given under both its old and its new name, with different values.
    """
    for old, new in RENAMED_KEYS.items():
        if old in data:
            if new in data and data[new] != data[old]:
                raise BituneError(f"{old}={data[old]!r} and {new}={data[new]!r} disagree: {old} is the older name "
                                  f"of {new}; set {new} only")
            warnings.warn(f"the setting {old} is now called {new}: write {new}: {data[old]} (the old name is "
                          "still read)", DeprecationWarning, stacklevel=2)
            data = {(new if k == old else k): v for k, v in data.items() if not (k == new and old in data)}
    section = data.get("bitune")
    if not isinstance(section, dict) or not any(k in section for k in RUNTIME_KEYS):
        return data
    data = {**data, "bitune": {k: v for k, v in section.items() if k not in RUNTIME_KEYS}}
    for key in RUNTIME_KEYS:
        if key in section:
            if key in data and data[key] != section[key]:
                raise BituneError(f"bitune.{key}={section[key]!r} and {key}={data[key]!r} disagree; set {key} only")
            data[key] = section[key]
    return data


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def field_docs(cls: type = TrainSettings) -> dict[str, str]:
    """The one-line docstring of every field of a settings dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def load_settings(path: str | Path | list[str | Path] | None = None,
                  overrides: list[str] | tuple[str, ...] = ()) -> TrainSettings:
    """Read settings from YAML files (following ``extends:``) and apply ``key=value`` overrides.

    Args:
        path: YAML config file, or several merged in order (later ones win, sections merge key by key, so
            ``[task.yaml, methods/lora16.yaml]`` trains the LoRA16 baseline on a task); ``None``: the defaults.
        overrides: ``"key=value"`` strings; dotted keys reach into sections (``bitune.rank=16``); values are
            parsed as YAML (``steps=100``, ``eval_split=null``).

    Raises:
        BituneError: unreadable file, malformed YAML, unknown key or invalid value.
    """
    paths = [] if path is None else [path] if isinstance(path, (str, Path)) else list(path)
    data: dict[str, Any] = {}
    for p in paths:
        data = _merge(data, read_yaml(p))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise BituneError(f"--set {item!r}: expected key=value, e.g. --set lr=1e-3 or --set bitune.rank=16")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        if value is not None and not isinstance(value, str) and _is_text_setting(key.strip()):
            value = raw  # a text setting takes the text as written: output_dir={variant}, model=007
        _set_dotted(data, key.strip(), value)
    settings = TrainSettings.from_dict(data)
    # the keys the files and --set named (dotted in a section): what --resume may not take from the saved run
    settings.given = frozenset({k for k, v in data.items() if not isinstance(v, dict)}
                               | {f"{k}.{n}" for k, v in data.items() if isinstance(v, dict) for n in v})
    return settings


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """One YAML config as a dict, merged over the file it ``extends`` (recursively).

    ``path`` is a local file or a packaged config's name (:func:`bitune.config_files.resolve_config`); an
    ``extends`` is resolved relative to the file, else as a packaged config's name."""
    path = resolve_config(path) if not _seen else path
    if path.resolve() in _seen:
        raise BituneError(f"{path}: 'extends' forms a cycle")
    try:
        data = yaml.load(read_text(path, "config file"), Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        raise BituneError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from e
    if data is None:  # an empty file (or comments only): most likely the wrong file, not "all defaults"
        raise BituneError(f"{path}: holds no settings (empty); leave --config out to train with the defaults")
    if not isinstance(data, dict):
        raise BituneError(f"{path}: expected a mapping of settings at the top level")
    parent = data.pop(EXTENDS_KEY, None)
    if parent is None:
        return data
    base = read_yaml(resolve_extends(str(parent), path), (*_seen, path.resolve()))
    return _merge(base, data)


# --------------------------------------------------------------------------------------------------- helpers
class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (YAML allows no duplicate keys; PyYAML would
    keep the last one silently: ``lr: 1e-3`` then, further down, ``lr: 3e-4``)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' merges keys that the mapping may override
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                            key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise BituneError(f"--set {key}: {'.'.join(parents[:i + 1])} is not a section")
        node = child
    node[last] = value


def _check_keys(data: dict[str, Any], allowed: list[str], prefix: str) -> None:
    for key in data:
        if key not in allowed:
            close = [f"{prefix}{c}" for c in difflib.get_close_matches(str(key), allowed, n=1)]
            if not close and not prefix:  # a model setting without its section: init_share -> bitune.init_share
                close = [f"bitune.{c}" for c in difflib.get_close_matches(str(key), field_names(BituneConfig), n=1)]
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise BituneError(f"unknown setting '{prefix}{key}'{hint}; allowed: {', '.join(allowed)}")
    if isinstance(data.get("bitune"), dict):
        _check_keys(data["bitune"], field_names(BituneConfig), "bitune.")


def _bitune_config(data: dict[str, Any]) -> BituneConfig:
    _check_keys(data, field_names(BituneConfig), "bitune.")
    hints = typing.get_type_hints(BituneConfig)
    data = {k: v if k == "target_modules" else _coerce(f"bitune.{k}", v, hints[k]) for k, v in data.items()}
    try:
        return BituneConfig(**data)
    except ValueError as e:
        raise BituneError(f"bitune: {e}") from e


def _is_text_setting(key: str) -> bool:
    """Whether a (dotted) setting is typed ``str`` or ``str | None``."""
    section, _, name = key.rpartition(".")
    hints = {"": _hints(), "bitune": typing.get_type_hints(BituneConfig)}.get(section, {})
    return hints.get(name) in (str, str | None)  # also typing.Optional[str]: they compare equal


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainSettings)


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Check ``value`` against a simple annotation (int, float, str, bool, X | None), converting YAML strings
    like ``1e-3`` (YAML 1.1 reads them as text) and ints for floats. Numbers must be finite, and a boolean is
    never a number (``lr=true`` is an error, not 1.0)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
    if hint not in (float, int, str, bool):
        return value  # checked by the section's own dataclass
    if hint is float and not isinstance(value, bool) and isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except ValueError:
            pass
        else:
            if not math.isfinite(number):
                raise BituneError(f"{name}={value!r} is not a finite number")
            return number
    elif hint is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif hint is str:
        if isinstance(value, bool) and name.endswith("bf16"):
            return str(value).lower()
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    elif hint is bool and isinstance(value, bool):
        return value
    quote = " (quote a text that starts with '{' or '[' in YAML)" if isinstance(value, (dict, list)) else ""
    kind = {float: "float (a number)", int: "int (a whole number)", str: "str (a text)", bool: "bool (true/false)"}
    raise BituneError(f"{name}={value!r} is not a valid {kind[hint]}{quote}")


def _positive(value: int) -> bool:
    return value >= 1


_POSITIVE = "{name} must be a positive integer, got {value}"
_AT_LEAST_0 = "{name} must be >= 0, got {value}"
CHECKS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("prompt_passes", lambda v: v in PROMPT_PASSES, f"{{name}}={{value!r}} is not one of {list(PROMPT_PASSES)}"),
    ("clip", lambda v: v in CLIP_CHOICES, f"{{name}}={{value!r}} is not one of {list(CLIP_CHOICES)}"),
    ("bf16", lambda v: v in BF16_CHOICES, f"{{name}}={{value!r}} is not one of {list(BF16_CHOICES)}"),
    *((name, _positive, _POSITIVE) for name in ("max_length", "batch_size", "grad_accum", "log_every", "limit",
                                                "eval_limit", "steps", "data_steps", "eval_every", "save_every",
                                                "save_total_limit")),
    ("seed", lambda v: 0 <= v < 2**32, "{name} must be in [0, 2**32), got {value}"),
    ("model", bool, "{name} must name a base model"),
    ("dataset", bool, "{name} must name a dataset"),
    ("epochs", lambda v: v > 0, "{name} must be > 0, got {value}"),  # also when steps overrides it: a mistake
    ("lr", lambda v: v > 0, "{name} must be > 0, got {value}"),
    ("warmup_ratio", lambda v: 0.0 <= v < 1.0, "{name} must be in [0, 1), got {value}"),
    *((name, lambda v: v >= 0, _AT_LEAST_0) for name in ("weight_decay", "max_grad_norm", "num_workers")),
    ("output_dir", bool, "{name} must be a folder path"),
)
"""The checks of single settings, in order, after each value's type is checked: (field, check, message naming
the field and the value); a field set to None (where its type allows it) is not checked."""


__all__ = ["TrainSettings", "load_settings", "read_yaml", "field_docs", "field_names", "upgrade"]
