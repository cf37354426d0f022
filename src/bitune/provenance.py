"""Where a result came from: package versions and the source commit, recorded in every run's log and eval file.

A study compares runs only when they come from one commit (the training order, the templates and the scoring are
all code); :func:`source_commit` is what ``log.jsonl``'s first record and ``eval.json``'s config carry to check it.
"""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def versions() -> dict[str, str]:
    """Versions of python and the packages that decide the numbers."""
    out = {"python": platform.python_version()}
    for pkg in ("bitune", "torch", "transformers", "peft", "lm_eval"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def source_commit() -> str | None:
    """The git commit of the source tree this package is imported from, with ``+dirty`` when tracked files under
    ``src/`` differ from it; None when the package is not imported from a git checkout (an installed wheel)."""
    src = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", str(src))
    return commit + ("+dirty" if dirty else "")


__all__ = ["source_commit", "versions"]
