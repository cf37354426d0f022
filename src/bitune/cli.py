"""The ``bitune`` command: one verb per module, each module owning its options.

A verb module exposes ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``; modules are
imported only when their verb runs, so ``bitune --help`` stays fast. A user error (bad name, malformed data,
impossible config, corrupt checkpoint) prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps a verb's description (examples) as written and shows each option's default."""


VERBS: dict[str, tuple[str, str]] = {
    "quickstart": ("bitune.quickstart", "fine-tune LoRA and Bitune on a small real task offline and compare them"),
    "train": ("bitune.train.cli", "train a Bitune model or a baseline from a YAML config"),
    "eval": ("bitune.eval.cli", "evaluate a checkpoint or base model with lm-evaluation-harness"),
    "report": ("bitune.eval.report", "aggregate evaluation runs over seeds into the paper's table"),
    "sweep": ("bitune.eval.sweep", "train and evaluate methods x seeds, then report"),
    "generate": ("bitune.generate", "generate answers from a checkpoint"),
    "chat": ("bitune.chat", "multi-turn chat with a checkpoint in the terminal"),
    "plot": ("bitune.plot", "plot mixing ratios over training and attention maps"),
    "bench": ("bitune.bench", "benchmark training and generation speed/memory against LoRA"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bitune", description="Bitune: bidirectional instruction-tuning "
                                     "for decoder-only LLMs.")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, (module, help_text) in VERBS.items():
        if verb in sys.argv[1:2] or "-h" in sys.argv[1:2] or "--help" in sys.argv[1:2] or len(sys.argv) < 2:
            p = sub.add_parser(verb, help=help_text, description=help_text,
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
            if verb in sys.argv[1:2]:
                importlib.import_module(module).configure(p)
        else:
            sub.add_parser(verb, help=help_text)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    parser = build_parser()
    args = parser.parse_args()
    if args.verb is None:
        parser.print_help()
        return 2
    module = importlib.import_module(VERBS[args.verb][0])
    try:
        return int(module.run(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"bitune {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"bitune {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
