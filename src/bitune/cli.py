"""The ``bitune`` command: one verb per module of :mod:`bitune.commands`, each module owning its options.

A verb module exposes ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``; modules are
imported only when their verb runs, so ``bitune --help`` stays fast. :func:`main` is the one error boundary:
a user error (bad name or value, malformed or undecodable data, a path that cannot be written, a corrupt
checkpoint; and a bad command line, see :class:`~bitune.commands.options.ArgumentParser`) prints one
``bitune VERB: error: ...`` line and exits with status 2; any other exception prints
one line pointing at ``--debug`` (which shows the traceback) and exits with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path

from .commands.options import ArgumentParser, HelpFormatter, VerbParser
from .errors import BituneError
from .processes import ERROR_DIR_ENV

VERBS: dict[str, tuple[str, str]] = {
    "quickstart": ("bitune.commands.quickstart",
                   "fine-tune LoRA and Bitune on a small real task offline and compare them"),
    "train": ("bitune.commands.train", "train a Bitune model or a baseline from a YAML config"),
    "eval": ("bitune.commands.eval", "evaluate a checkpoint or base model with lm-evaluation-harness"),
    "report": ("bitune.commands.report", "aggregate evaluation runs: the paper's table, intervals, paired differences"),
    "sweep": ("bitune.commands.sweep", "train and evaluate methods x seeds, then report"),
    "generate": ("bitune.commands.generate", "generate answers from a checkpoint"),
    "chat": ("bitune.commands.chat", "multi-turn chat with a checkpoint in the terminal"),
    "plot": ("bitune.commands.plot", "plot mixing ratios over training and attention maps"),
    "bench": ("bitune.commands.bench", "benchmark training, generation and serving speed/memory against LoRA"),
    "export": ("bitune.commands.export", "export a checkpoint's causal weights merged, as a plain transformers model"),
    "serve": ("bitune.commands.serve", "serve a checkpoint over an OpenAI-compatible HTTP API (continuous batching)"),
    "configs": ("bitune.commands.configs", "list the packaged configs, or copy one for editing"),
}
DEBUG_HELP = "show the full traceback of an unexpected error"
EXTRAS: dict[str, str] = {"lm_eval": "eval", "scipy": "eval", "matplotlib": "plot", "fastapi": "serve",
                          "uvicorn": "serve", "starlette": "serve", "trl": "trl"}
"""The optional packages a verb may need, each with the extra of ``pyproject.toml`` that installs it."""


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (``None``: leave torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise BituneError(f"--threads {threads}: needs a positive number of threads")
    import torch  # here, not at the top: help and settings validation do not load torch

    torch.set_num_threads(threads)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="bitune", description="Bitune: bidirectional instruction-tuning "
                                     "for decoder-only LLMs.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=VerbParser)
    for verb, (module, help_text) in VERBS.items():
        if verb in sys.argv[1:2] or "-h" in sys.argv[1:2] or "--help" in sys.argv[1:2] or len(sys.argv) < 2:
            p = sub.add_parser(verb, help=help_text, description=help_text, formatter_class=HelpFormatter)
            if verb in sys.argv[1:2]:
                importlib.import_module(module).configure(p)
                p.formatter_class = HelpFormatter
                p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        else:
            sub.add_parser(verb, help=help_text)
    return parser


def missing_extra(e: ModuleNotFoundError, verb: str) -> str | None:
    """The error line for a verb whose optional extra is not installed (None: ``e`` is no extra's package)."""
    package = (e.name or "").split(".")[0]
    extra = EXTRAS.get(package)
    if extra is None:
        return None
    return f"bitune {verb}: error: 'bitune {verb}' needs {package}, which is not installed: pip install \"bitune[{extra}]\""


def error_line(e: BaseException) -> str:
    """One line for a user-facing error: the message with its line breaks folded; an ``OSError`` as
    "strerror: filename"; a ``UnicodeError`` as what could not be decoded or encoded."""
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        text = f"{e.filename}: {e.strerror}"
    elif isinstance(e, UnicodeError) and not str(e).startswith("bitune"):
        text = f"text that is not valid UTF-8 ({e})"
    else:
        text = str(e) or type(e).__name__
    return " ".join(text.split())


def report_error(line: str) -> None:
    """Print the one error line; in a job started by ``--num-processes``, also leave it where the launcher reads
    what each process printed (:mod:`bitune.commands.launcher` shows every error once)."""
    print(line, file=sys.stderr)
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        with contextlib.suppress(OSError):
            (Path(folder) / f"error-{os.environ.get('RANK', '0')}.txt").write_text(line + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]  # accepted anywhere before '--', also after a verb's own sub-verb
    sys.argv = [sys.argv[0], *(a for i, a in enumerate(argv) if i >= end or a != "--debug")]
    parser = build_parser()
    args = parser.parse_args()
    args.debug = debug
    if args.verb is None:
        parser.print_help()
        return 2
    try:
        set_threads(getattr(args, "threads", None))
        module = importlib.import_module(VERBS[args.verb][0])
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"bitune {args.verb}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:  # BituneError and UnicodeError are ValueErrors
        if args.debug:
            raise
        report_error(f"bitune {args.verb}: error: {error_line(e)}")
        return 2
    except Exception as e:
        if args.debug:
            raise
        extra = missing_extra(e, args.verb) if isinstance(e, ModuleNotFoundError) else None
        if extra is not None:  # an optional extra that is not installed: a user error, not a bug
            report_error(extra)
            return 2
        report_error(f"bitune {args.verb}: error: unexpected {type(e).__name__}: {error_line(e)} "
                     f"(run with --debug for the traceback)")
        return 1


def run_script(name: str, script: Callable[[], int | None]) -> int:
    """Run a script of ``scripts/`` as a verb runs: an error of its input (a ``ValueError``, ``BituneError`` among
    them, or an ``OSError``) is one line ``NAME: error: ...`` and exit status 2; a bug keeps its traceback.

    Returns:
        The exit status (the script's own, 0 when it returns None).
    """
    try:
        return int(script() or 0)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"{name}: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
