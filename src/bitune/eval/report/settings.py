"""A study's own report settings: which methods a report shows first and in which order, and which baselines
``bitune`` is matched against. They live beside the runs, in a ``report.yaml`` the study writes; the library knows
no study's method names. Without the file, the untrained ``pretrained`` baseline comes first and the other methods
follow by name, and ``bitune`` is paired with every other
method.

Example ``report.yaml``::

    methods: [pretrained, lora, lora16, bitune]   # rows in this order, then any other method by name
    fair_baselines: [lora16]                      # bitune is also paired with these (besides --baselines)
    pairs: [[lora_compute_newdata, lora_compute]] # further comparisons, each [method, baseline]
    runs: [arc_easy, csqa]                        # the study's report reads these folders only (not tuning/)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from ...errors import BituneError, did_you_mean
from ...files import read_text

SETTINGS_FILE = "report.yaml"


@dataclass(frozen=True)
class ReportSettings:
    """How one study's report orders and pairs its methods."""

    methods: tuple[str, ...] = ("pretrained",)
    """Methods shown first, in this order (rows, the summary's columns, the figure); every other method follows
    by name. Default: the untrained baseline first."""
    fair_baselines: tuple[str, ...] | None = None
    """Methods ``bitune`` is paired with besides ``--baselines``: e.g. those matching its trainable parameters or
    its training compute. None (the default): every other method that is not one of the paper's ablations."""
    pairs: tuple[tuple[str, str], ...] = ()
    """Further comparisons, each ``[method, baseline]``, made wherever both ran and adjusted with the others: e.g.
    two arms of one baseline that differ in one factor (LoRA given Bitune's compute on the same questions and on new
    ones). Default: none."""
    runs: tuple[str, ...] | None = None
    """Folders, relative to the ``report.yaml``, whose runs make the study's report when ``bitune report`` is
    given the study's folder (e.g. the reported split's, leaving out a ``tuning/`` folder of runs on another
    split); each must exist (a missing one is an error, not a method left out of the report). None (the
    default): every run below the study's folder."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("fair_baselines", "runs"):
                continue
            if f.name == "pairs":
                object.__setattr__(self, "pairs", _pairs(value))
                continue
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
                raise BituneError(f"report setting {f.name}: a list of {'folder' if f.name == 'runs' else 'method'} names, "
                                  f"not {value!r}")
            twice = next((v for v in value if list(value).count(v) > 1), None)
            if twice is not None:
                raise BituneError(f"report setting {f.name}: {twice!r} is named twice")
            object.__setattr__(self, f.name, tuple(value))
        for run in self.runs or ():
            if Path(run).is_absolute() or ".." in Path(run).parts:
                raise BituneError(f"report setting runs: {run!r} is not a folder inside the study's folder")

    def check_names(self, labels: set[str], path: Path) -> None:
        """Every method these settings name (``methods`` where given, ``fair_baselines``, ``pairs``) is the label
        of a run in ``labels`` (the study's): a name that matches none would drop its comparison, or its place in
        the order, without a word.

        Raises:
            BituneError: naming the file, the setting, the name and the closest label.
        """
        named = [("methods", m) for m in self.methods if self.methods != ReportSettings.methods]
        named += [("fair_baselines", m) for m in self.fair_baselines or ()]
        named += [("pairs", m) for pair in self.pairs for m in pair]
        for setting, name in named:
            if name not in labels:
                raise BituneError(f"{path}: {setting} names {name!r}, but no run of the study is labelled so"
                                  f"{did_you_mean(name, labels)}; the runs' methods: {', '.join(sorted(labels))}")

    def method_key(self, label: str) -> tuple[int, str]:
        """Sort key: the methods named in :attr:`methods` first, in that order, then the others by name."""
        return (self.methods.index(label), "") if label in self.methods else (len(self.methods), label)


def _pairs(value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, (list, tuple)):
        raise BituneError(f"report setting pairs: a list of [method, baseline] pairs, not {value!r}")
    pairs = []
    for pair in value:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(v, str) and v.strip() for v in pair)):
            raise BituneError(f"report setting pairs: each a [method, baseline] pair of two method names, not {pair!r}")
        if pair[0] == pair[1]:
            raise BituneError(f"report setting pairs: {list(pair)!r} compares a method with itself")
        if tuple(pair) in pairs:
            raise BituneError(f"report setting pairs: {list(pair)!r} is named twice")
        pairs.append(tuple(pair))
    return tuple(pairs)


def read_settings(path: Path) -> ReportSettings:
    """The settings in a ``report.yaml``.

    Raises:
        BituneError: the file is not YAML, not a mapping, names an unknown setting or holds a bad value (naming
            the file and the setting).
    """
    try:
        data = yaml.safe_load(read_text(path, "report settings"))
    except yaml.YAMLError as e:
        raise BituneError(f"{path}: not valid YAML ({e})") from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise BituneError(f"{path}: a mapping of report settings, not {type(data).__name__}")
    known = [f.name for f in fields(ReportSettings)]
    for key in data:
        if key not in known:
            raise BituneError(f"{path}: unknown setting {key!r}{did_you_mean(key, known)}; known: "
                              f"{', '.join(known)}")
    try:
        return ReportSettings(**data)
    except BituneError as e:
        raise BituneError(f"{path}: {e}") from e


def find_settings(paths: list[str] | list[Path]) -> tuple[ReportSettings, Path | None]:
    """The settings of the study the runs belong to: the nearest ``report.yaml`` in each given folder (a given
    file's folder) or above it, as pytest and ruff find their configuration.

    Returns:
        settings: The study's settings, or the defaults when no input has a ``report.yaml``.
        path: The file read, or None.

    Raises:
        BituneError: the inputs lie in studies with different ``report.yaml`` files, or the file is invalid.
    """
    found: set[Path] = set()
    for p in paths:
        folder = Path(p).expanduser().resolve()
        folder = folder if folder.is_dir() else folder.parent
        here = next((d / SETTINGS_FILE for d in (folder, *folder.parents) if (d / SETTINGS_FILE).is_file()), None)
        if here is not None:
            found.add(here)
    if len(found) > 1:
        raise BituneError(f"the runs lie in studies with different report settings ({', '.join(map(str, sorted(found)))}"
                          "): report each study apart")
    if not found:
        return ReportSettings(), None
    path = found.pop()
    return read_settings(path), path
