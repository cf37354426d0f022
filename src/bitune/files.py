"""Writing files and folders so that a reader never sees them half-written."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .errors import BituneError, closest


def replace_dir(src: Path, dst: Path, keep: tuple[str, ...] = ()) -> None:
    """Move the complete folder ``src`` to ``dst``; an existing ``dst`` is replaced only once ``src`` is done.

    Args:
        keep: names of entries of ``dst`` that the writer did not write (a user's README.md, notes): copied into
            ``src`` first (unless ``src`` has one of that name), so they survive the replacement; until the
            rename, the originals stay where they are. The replaced folder is moved aside under a new name of its
            own (``.<dst>.old-*``, made for it) and deleted last: nothing else in ``dst``'s parent is touched.
    """
    if dst.exists():
        for name in keep:
            entry, copy = dst / name, src / name
            if copy.exists() or not (entry.exists() or entry.is_symlink()):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, copy, symlinks=True)
            else:
                shutil.copy2(entry, copy, follow_symlinks=False)
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))  # a new name: never a user's
        os.replace(dst, old)  # onto the new, empty folder
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def apply_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the permissions the user's umask gives new files (0755 / 0644 under
    umask 022), where temporary folders (0700) and safetensors files (0600) are created private."""
    mask = os.umask(0o022)
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to a temporary file next to ``path`` (creating its folder) and rename it into
    place; on any failure the temporary file is removed and ``path`` is left as it was. Each call has a temporary
    file of its own: two processes writing ``path`` at once both succeed, the last rename wins (with one shared
    name, one renamed away the file the other was about to rename)."""
    path = Path(path)
    check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:  # "x": never another writer's file; mode as umask allows
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_output_file(path: str | Path, what: str = "output file",
                      keep: tuple[tuple[str, str | Path | None], ...] = ()) -> Path:
    """Check, before any work, that a file can be written at ``path``: not a folder, its nearest existing parent a
    folder this process may write into, and none of the inputs in ``keep``.

    Args:
        keep: ``(name, path)`` of what the command reads (an input file, a checkpoint folder: anything in it):
            writing there would destroy it. A ``None`` path is skipped.

    Raises:
        BituneError: naming ``what``, the path and the problem (also an empty or blank path, which would name
            the current folder or a file called " ").
    """
    path = Path(check_named(path, what)).expanduser()
    target = path.resolve()
    for name, kept in _resolved(keep):
        if target == kept or (kept.is_dir() and kept in target.parents):
            raise BituneError(f"{what} {path} would overwrite {name} {kept}; write somewhere else" if target == kept
                              else f"{what} {path} is inside {name} {kept}, which must stay as it is; write "
                                   "somewhere else")
    if path.is_dir():
        raise BituneError(f"{what} {path} is a folder; give a file path")
    _check_parent(path, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise BituneError(f"{what} {path} exists and is not writable (permission denied)")
    return path


def check_replaces_own(path: str | Path, what: str, kind: str, earlier: Callable[[Any], bool],
                       form: str = "json") -> None:
    """An existing file at ``path`` is replaced only when it is an earlier output of the same kind (re-running a
    command updates its own output); any other file is not the command's to replace. An empty file holds nothing
    to lose. Every verb that writes a file where one may already be calls this before its first unit of work.

    Args:
        what: the option, e.g. ``"--output"``.
        kind: what an earlier output is, for the error (``"an evaluation result"``).
        earlier: whether the file's content is such an output, called with it read as ``form`` says; content that
            cannot be read so is never an earlier output.
        form: ``"json"`` (one JSON value), ``"jsonl"`` (the list of its non-blank lines' JSON values), ``"text"``
            (UTF-8 text) or ``"bytes"``.

    Raises:
        BituneError: ``path`` exists and is not ``kind`` (naming the option, the file and how to proceed).
    """
    path = Path(path).expanduser()
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        content = path.read_bytes()
        if form != "bytes":
            content = content.decode("utf-8")
        if form == "jsonl":
            content = [json.loads(line) for line in content.splitlines() if line.strip()]
        elif form == "json":
            content = json.loads(content)
        ours = earlier(content)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        ours = False
    if not ours:
        raise BituneError(f"{what} {path} exists and is not {kind}; it would be replaced: give another file, or "
                          "move it away first")


def is_figure(data: bytes) -> bool:
    """Whether ``data`` is a PNG that matplotlib wrote (its ``Software`` text chunk): what an earlier figure of
    ``bitune plot`` or ``bitune report`` is, for :func:`check_replaces_own` with ``form="bytes"``."""
    return data.startswith(b"\x89PNG") and b"Matplotlib" in data


def _resolved(keep: tuple[tuple[str, str | Path | None], ...]) -> list[tuple[str, Path]]:
    """The ``(name, path)`` pairs of ``keep`` that name a path, each path resolved (``None`` ones skipped)."""
    return [(name, Path(kept).expanduser().resolve()) for name, kept in keep if kept is not None]


def check_output_dir(path: str | Path, what: str = "output folder",
                     keep: tuple[tuple[str, str | Path | None], ...] = ()) -> Path:
    """Check, before any work, that ``path`` is (or can be created as) a folder this process may write into, and
    that it neither is, holds nor lies inside any folder in ``keep``.

    Args:
        keep: ``(name, path)`` of what must stay as it is: what the command reads and what another saved artefact
            needs (a checkpoint's base model). A ``None`` path is skipped.

    Raises:
        BituneError: naming ``what``, the path and the problem (also an empty or blank path).
    """
    path = Path(check_named(path, what)).expanduser()
    target = path.resolve()
    for name, kept in _resolved(keep):
        if target == kept or target in kept.parents or kept in target.parents:
            how = "is" if target == kept else "holds" if target in kept.parents else "is inside"
            raise BituneError(f"{what} {path} {how} {name} {kept}, which must stay as it is; write somewhere else")
    if path.exists() and not path.is_dir():
        raise BituneError(f"{what} {path} is a file, not a folder")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise BituneError(f"{what} {path} is not writable (permission denied)")
        return path
    _check_parent(path, what)
    return path


def check_named(path: str | Path, what: str) -> str | Path:
    """``path`` unchanged unless it is an empty or blank string: ``Path("")`` is the current folder and ``" "`` a
    file called " ", never what a user meant to name.

    Raises:
        BituneError: ``what`` is empty.
    """
    if isinstance(path, str) and not path.strip():
        raise BituneError(f"{what} is empty: give a path" if not path else f"{what} {path!r} is blank: give a path")
    return path


def check_input_file(path: str | Path, what: str = "file", expected: str | None = None) -> Path:
    """Check, before it is read, that ``path`` names an existing file.

    Args:
        what: names the file in the error, e.g. ``"--input"``.
        expected: the file name usually given here (e.g. ``log.jsonl``): a folder holding it is named in the hint.

    Raises:
        BituneError: the path is empty, does not exist (with the closest name in its folder, if one is close) or is
            a folder (with ``folder/expected`` as the hint when that file exists).
    """
    path = Path(check_named(path, what)).expanduser()
    if path.is_dir():
        hint = f" (did you mean {path / expected}?)" if expected and (path / expected).is_file() else ""
        raise BituneError(f"{what} {path} is a folder, not a file{hint}")
    if not path.exists():
        try:
            close = closest(path.name, [p.name for p in path.parent.iterdir()], cutoff=0.8)  # a typo, not a guess
        except OSError:  # no such folder either, or not readable
            close = None
        hint = f" (did you mean {path.with_name(close)}?)" if close else ""
        raise BituneError(f"{what} {path}: not found{hint}")
    return path


def _check_parent(path: Path, what: str) -> None:
    """The nearest existing ancestor of ``path`` must be a writable folder (the rest is created)."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise BituneError(f"{what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BituneError(f"{what} {path}: cannot write into {parent} (permission denied)")


def read_text(path: str | Path, what: str = "file") -> str:
    """The UTF-8 text of ``path``.

    Raises:
        BituneError: the path is empty; the file is missing, unreadable or not UTF-8 (naming the file and the byte
            offset).
    """
    path = Path(check_named(path, what)).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[:e.start].count(b"\n") + 1
        raise BituneError(f"{what} {path}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset "
                          f"{e.start}, line {line})") from e
    except OSError as e:
        raise BituneError(f"{what} {path}: cannot be read ({e.strerror or e})") from e


def jsonl_records(path: str | Path, what: str = "file") -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line of a JSON-lines file (read as :func:`read_text` reads it).

    Raises:
        BituneError: the file cannot be read as UTF-8 text, or a line is not valid JSON (naming ``path:line``).
    """
    for n, line in enumerate(read_text(path, what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise BituneError(f"{path}:{n}: not valid JSON ({e.msg})") from e


def check_text(text: str, where: str) -> str:
    """``text`` unchanged if it can be written as UTF-8; else a BituneError naming ``where`` (a lone surrogate,
    e.g. from undecodable bytes on the command line or a ``\\ud800`` escape in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BituneError(f"{where}: not valid UTF-8 text (character {text[e.start]!r} at position {e.start})") from e
    return text
