"""Writing files and folders so that a reader never sees them half-written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete folder ``src`` to ``dst``; an existing ``dst`` is replaced only once ``src`` is done."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file next to ``path`` (creating its folder) and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
