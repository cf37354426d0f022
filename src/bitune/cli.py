"""The ``bitune`` command: one verb per module, each module owning its options.

A verb module exposes ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``; modules are
imported only when their verb runs, so ``bitune --help`` stays fast. :func:`main` is the one error boundary:
a user error (bad name or value, malformed or undecodable data, a path that cannot be written, a corrupt
checkpoint) prints one ``bitune VERB: error: ...`` line and exits with status 2; any other exception prints
one line pointing at ``--debug`` (which shows the traceback) and exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps a verb's description (examples) as written and shows each option's default once (none shown
    for unset options, flags, or help that already says its default)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Prose lines are wrapped to the terminal; indented lines (examples, lists) stay exactly as written."""
        import textwrap

        out = []
        for line in text.splitlines():
            if line[:1].isspace() or len(line) <= width:
                out.append(indent + line)
            else:
                out += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent,
                                     break_on_hyphens=False)
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in help_text:
            return help_text
        return super()._get_help_string(action)


VERBS: dict[str, tuple[str, str]] = {
    "quickstart": ("bitune.quickstart", "fine-tune LoRA and Bitune on a small real task offline and compare them"),
    "train": ("bitune.train.cli", "train a Bitune model or a baseline from a YAML config"),
    "eval": ("bitune.eval.cli", "evaluate a checkpoint or base model with lm-evaluation-harness"),
    "report": ("bitune.eval.report", "aggregate evaluation runs: the paper's table, intervals, paired differences"),
    "sweep": ("bitune.eval.sweep", "train and evaluate methods x seeds, then report"),
    "generate": ("bitune.generate", "generate answers from a checkpoint"),
    "chat": ("bitune.chat", "multi-turn chat with a checkpoint in the terminal"),
    "plot": ("bitune.plot", "plot mixing ratios over training and attention maps"),
    "bench": ("bitune.bench", "benchmark training and generation speed/memory against LoRA"),
}
DEBUG_HELP = "show the full traceback of an unexpected error"


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's CPU threads for the verb (read by :func:`main`)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads (torch.set_num_threads; default: torch's own, i.e. "
                             "OMP_NUM_THREADS or the number of cores)")


def add_prompt_passes_option(parser: argparse.ArgumentParser) -> None:
    """``--prompt-passes``: how the prompt passes run (a runtime choice; every choice gives the same numbers)."""
    from .config import PROMPT_PASSES

    parser.add_argument("--prompt-passes", choices=list(PROMPT_PASSES), default="auto",
                        help="how the passes run: fused (scoring: prompt passes and answer in one forward), "
                             "batched (both prompt passes as one forward over 2B rows; what fused and auto read "
                             "prompts with) or sequential (one forward per pass); every choice gives the same "
                             "numbers, only the speed differs")


def set_threads(threads: int | None) -> None:
    """Apply ``--threads`` (``None``: leave torch's default)."""
    if threads is None:
        return
    if threads < 1:
        from .errors import BituneError

        raise BituneError(f"--threads {threads}: needs a positive number of threads")
    import torch

    torch.set_num_threads(threads)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bitune", description="Bitune: bidirectional instruction-tuning "
                                     "for decoder-only LLMs.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
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
        print(f"bitune {args.verb}: error: {error_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if args.debug:
            raise
        print(f"bitune {args.verb}: error: unexpected {type(e).__name__}: {error_line(e)} "
              f"(run with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
