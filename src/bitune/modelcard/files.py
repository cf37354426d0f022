"""The card file (``README.md``) of a checkpoint folder: whose it is, writing it, refreshing its evaluation, reading
its training section back.

A card bitune wrote carries :data:`~bitune.modelcard.text.MARKER` (and ``library_name: bitune``) and is rewritten
on every save. A ``README.md`` without them is the user's own: it is never overwritten (a save that replaces the
folder carries it over byte for byte). The card is written to a temporary file and renamed into place, inside the
folder a save builds before renaming it into place.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..config import BituneConfig
from ..files import write_text_atomic
from .evaluation import find_evaluation
from .text import EXPORT_MARKER, MARKER, Training, evaluation_section, render, training_of

CARD_FILE = "README.md"

def is_ours(path: str | Path) -> bool:
    """Whether ``path`` is a card bitune wrote (:data:`MARKER` and ``library_name: bitune`` in its metadata)."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    front = re.match(r"---\n(.*?)\n---\n", text, re.S)
    if not front:
        return False
    if MARKER in text:
        return re.search(r"^library_name: bitune$", front.group(1), re.M) is not None
    return EXPORT_MARKER in text and re.search(r"^library_name: transformers$", front.group(1), re.M) is not None

def write_card(folder: str | Path, text: str, previous: str | Path | None = None) -> bool:
    """Write the card ``text`` as ``folder/README.md``, atomically, unless a user's own README is to be kept.

    Args:
        folder: the checkpoint folder (or the temporary folder a save builds).
        text: from :func:`render`.
        previous: the folder ``folder`` will replace (a save builds a new folder and renames it over the old):
            a user's ``README.md`` there is copied into ``folder`` byte for byte instead of the card.

    Returns:
        Whether the card was written (False: a user's own README is kept).
    """
    target = Path(folder) / CARD_FILE
    if target.exists() or target.is_symlink():
        if not is_ours(target):
            return False
    elif previous is not None:
        old = Path(previous) / CARD_FILE
        if (old.exists() or old.is_symlink()) and not is_ours(old):
            shutil.copy2(old, target, follow_symlinks=False)
            return False
    write_text_atomic(target, text)
    return True

def write(folder: str | Path, config: BituneConfig, training: Training | None = None,
          destination: str | Path | None = None, replaces: bool = False) -> bool:
    """Render and write the card of the checkpoint being written into ``folder``.

    Args:
        folder: where the checkpoint's files are written now.
        config: its config.
        training: the run that saved it, if any.
        destination: where the files end up (default: ``folder`` itself): the path the card shows, where an
            ``eval.json`` is looked for, and whose user ``README.md`` is kept.
        replaces: ``folder`` is renamed over ``destination`` (whose own files, an ``eval.json`` of the checkpoint
            it held included, go with it).

    Returns:
        Whether the card was written (False: a user's own README is kept).
    """
    folder = Path(folder)
    destination = Path(destination) if destination is not None else folder
    text = render(config, destination, training, find_evaluation(destination, own=not replaces))
    return write_card(folder, text, previous=destination if destination != folder else None)

def refresh_evaluation(folder: str | Path) -> bool:
    """Bring the evaluation section of the card in checkpoint ``folder`` up to date with its ``eval.json``
    (``bitune eval`` calls it after writing one); the rest of the card is kept as it was saved.

    Returns:
        Whether the card was rewritten (False: no card of bitune's there, e.g. a user's own README).
    """
    target = Path(folder) / CARD_FILE
    if not is_ours(target):
        return False
    text = target.read_text(encoding="utf-8")
    head = text.split("\n\n## Evaluation\n", 1)[0].rstrip("\n")
    evaluation = find_evaluation(folder)
    write_text_atomic(target, head + ("\n\n" + evaluation_section(evaluation) if evaluation else "") + "\n")
    return True

def read_training(folder: str | Path) -> Training | None:
    """The training section of the card bitune wrote in checkpoint ``folder``, read back (None: no card of
    bitune's there, or one without training, e.g. a user's own README)."""
    card = Path(folder) / CARD_FILE
    if not is_ours(card):
        return None
    return training_of(card.read_text(encoding="utf-8"))
