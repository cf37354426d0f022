"""Config files by name: a local file first, else the config of that name shipped in the package.

The method, task, instruction, study and accelerate configs live in ``bitune/configs/`` (a clone's ``configs/``
links there), so they work from an installed wheel as from a clone. As torchtune resolves
``--config llama3/8B_lora``, ``--config methods/bitune`` (or ``methods/bitune.yaml``, or a clone's
``configs/methods/bitune.yaml``) reads the local file when one exists and the packaged config otherwise;
``bitune configs list`` shows them and ``bitune configs copy NAME DEST`` copies one for editing (like torchtune's
``tune ls`` and ``tune cp``).
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import BituneError, closest
from .files import check_input_file, check_named, read_text, write_text_atomic

PACKAGED = Path(__file__).resolve().parent / "configs"
"""The folder of the packaged configs."""
SUFFIX = ".yaml"
PREFIX = "configs/"
"""A clone's path to the packaged configs, accepted in front of a name (``configs/methods/bitune.yaml``)."""
_EXTENDS = re.compile(r"^(extends:\s*)(\S+)(.*)$", re.MULTILINE)


def packaged_names() -> list[str]:
    """Every packaged config by name (its path under ``bitune/configs/`` without ``.yaml``), sorted."""
    return sorted(p.relative_to(PACKAGED).with_suffix("").as_posix() for p in PACKAGED.rglob(f"*{SUFFIX}"))


def config_name(name: str) -> str:
    """``name`` without its ``.yaml``/``.yml`` ending, and only that: a name is its whole text, dots included
    (``theta_0.01``, where ``Path.stem`` gives ``theta_0``)."""
    return name.removesuffix(SUFFIX) if name.endswith(SUFFIX) else name.removesuffix(".yml")


def _files(path: Path) -> list[Path]:
    """The files a config name may mean: ``path`` itself, then ``path.yaml`` unless it already ends in .yaml/.yml
    (a dot elsewhere in the name is part of it: ``theta_0.01``)."""
    return [path] if path.name.endswith((SUFFIX, ".yml")) else [path, path.with_name(path.name + SUFFIX)]


def _packaged_key(name: str | Path) -> str:
    return str(name).replace("\\", "/").removeprefix("./").removeprefix(PREFIX)


def packaged_hint(name: str | Path) -> str:
    """``" (did you mean the packaged config X?)"`` for the packaged config closest to ``name``, or ``""``."""
    close = closest(config_name(_packaged_key(name)), packaged_names(), cutoff=0.8)
    return f" (did you mean the packaged config {close}?)" if close else ""


def find_packaged(name: str | Path) -> Path | None:
    """The packaged config called ``name`` (``methods/bitune``, ``methods/bitune.yaml`` or
    ``configs/methods/bitune.yaml``; ``methods/theta_0.01`` by its whole text), or ``None`` when there is none."""
    text = _packaged_key(name)
    if not text or text.startswith("/"):
        return None
    path = PACKAGED / (text if text.endswith((SUFFIX, ".yml")) else text + SUFFIX)
    if not path.is_file() or not path.resolve().is_relative_to(PACKAGED):
        return None
    return path


def resolve_config(name: str | Path, what: str = "config file") -> Path:
    """The file a config name means: the local file ``name`` (or ``name.yaml``) if it exists, else the packaged
    config of that name.

    Raises:
        BituneError: ``name`` is empty, a folder, or neither a local file nor a packaged config (naming the closest
            packaged config, if one is close).
    """
    path = Path(check_named(name, what)).expanduser()
    if path.is_dir():
        return check_input_file(path, what)  # raises: a folder, not a file
    for candidate in _files(path):
        if candidate.is_file():
            return candidate
    packaged = find_packaged(name)
    if packaged is not None:
        return packaged
    try:
        return check_input_file(path, what)  # raises: not found (with a local near miss)
    except BituneError as e:
        raise BituneError(f"{e}, nor a packaged config{packaged_hint(name)}; list them with 'bitune configs list'"
                          ) from None


def resolve_extends(parent: str, child: Path) -> Path:
    """The file an ``extends: parent`` line in ``child`` names: relative to ``child`` (``parent`` or
    ``parent.yaml``), else the packaged config ``parent`` (so an edited copy of a packaged config keeps extending
    its packaged base).

    Raises:
        BituneError: neither exists (naming the closest packaged config, if one is close).
    """
    local = child.parent / parent
    for candidate in _files(local):
        if candidate.is_file():
            return candidate
    packaged = find_packaged(parent)
    if packaged is not None:
        return packaged
    try:
        return check_input_file(local, f"config {child}: 'extends' file")  # raises: not found
    except BituneError as e:
        raise BituneError(f"{e}, nor a packaged config{packaged_hint(parent)}") from None


def describe(name: str) -> str:
    """The first comment line of a packaged config (what it is for), or ``""``."""
    path = find_packaged(name)
    for line in read_text(path, "config file").splitlines() if path else ():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def copy_config(name: str, dest: str | Path) -> Path:
    """Copy the packaged config ``name`` to ``dest`` (a file, or an existing folder to copy into) for editing.

    An ``extends:`` line naming a packaged file is rewritten to that file's packaged name, so the copy still
    extends it from anywhere. Never replaces a file.

    Returns:
        The path written.

    Raises:
        BituneError: no such packaged config, or ``dest`` exists (a file) or cannot be written.
    """
    source = find_packaged(name)
    if source is None:
        close = closest(config_name(_packaged_key(name)), packaged_names())
        hint = f" (did you mean {close}?)" if close else ""
        raise BituneError(f"no packaged config {name!r}{hint}; list them with 'bitune configs list'")
    target = Path(check_named(dest, "DEST")).expanduser()
    if str(dest).endswith(("/", "\\")) and not target.is_dir():
        raise BituneError(f"DEST {dest}: no such folder")
    if target.is_dir():
        target = target / source.name
    if target.exists() or target.is_symlink():
        raise BituneError(f"{target} already exists; copy to a new file name, or remove it first")
    if not target.parent.is_dir():
        raise BituneError(f"DEST {dest}: folder {target.parent} does not exist")

    def packaged_parent(m: re.Match) -> str:
        parent = (source.parent / m.group(2)).resolve()
        if not parent.is_file() or not parent.is_relative_to(PACKAGED):
            return m.group(0)
        return m.group(1) + parent.relative_to(PACKAGED).as_posix() + m.group(3)

    write_text_atomic(target, _EXTENDS.sub(packaged_parent, read_text(source, "config file")))
    return target
