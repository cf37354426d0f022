"""The one exception type for user-facing errors, and the near-miss hint its messages share."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class BituneError(ValueError):
    """A problem the user can fix: a bad name, malformed data, a missing field or a corrupt file.

    The message is one self-contained line that names the problem and, where possible, the fix.
    The CLI prints it and exits non-zero instead of showing a traceback.
    """


def closest(name: object, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The one of ``choices`` closest to ``name`` (letter case ignored), or None when none is close (difflib's
    similarity ratio below ``cutoff``)."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(str(name).strip().lower(), list(by_lower), n=1, cutoff=cutoff)
    return by_lower[close[0]] if close else None


def did_you_mean(name: object, choices: Iterable[str]) -> str:
    """The hint an "unknown name" error ends with: ``" (did you mean 'x'?)"`` for the choice closest to ``name``
    (:func:`closest`), or ``""`` when none is close.

    Args:
        name: what the user wrote.
        choices: the names that exist.
    """
    close = closest(name, choices)
    return f" (did you mean {close!r}?)" if close is not None else ""


__all__ = ["BituneError", "closest", "did_you_mean"]
