"""The one exception type for user-facing errors."""


class BituneError(ValueError):
    """A problem the user can fix: a bad name, malformed data, a missing field or a corrupt file.

    The message is one self-contained line that names the problem and, where possible, the fix.
    The CLI prints it and exits non-zero instead of showing a traceback.
    """
