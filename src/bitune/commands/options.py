"""Options and help formatting shared by the verbs: the parser (one-line errors), the help formatter, ``--threads``,
``--prompt-passes``,
the model options (``--checkpoint``/``--model``/...) and the decoding options of ``generate``, ``chat`` and
``plot attention``."""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path
from typing import NoReturn

from ..config import PROMPT_PASSES, merge_choice
from ..errors import BituneError


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with the CLI's error format: a bad command line prints one ``PROG: error: ...`` line
    that says where the help is (no usage block) and exits with status 2, like every other user error.

    Sub-parsers (the verbs, ``plot``'s figures, ``bench``'s targets) are made of the same class.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}; see {self.prog} --help\n")


class VerbParser(ArgumentParser):
    """The parser of a verb (and of a verb's own sub-verb): an argument it does not know is its error, named with
    its own ``prog`` (``bitune chat: error: unrecognized arguments: --compile; see bitune chat --help``), not
    passed up to ``bitune``'s parser, which would name neither the verb nor its help.

    The innermost sub-parser gets every argument after its name, so the error names the deepest verb given.
    """

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps a verb's description (examples) as written and shows each option's default once (none shown
    for unset options, flags, or help that already says its default)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Prose lines are wrapped to the terminal; indented lines (examples, lists) stay exactly as written."""
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


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's CPU threads for the verb (applied by :func:`bitune.cli.main`)."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads (torch.set_num_threads; default: torch's own, i.e. "
                             "OMP_NUM_THREADS or the number of cores)")


def add_prompt_passes_option(parser: argparse.ArgumentParser) -> None:
    """``--prompt-passes``: how the prompt passes run (a runtime choice; every choice gives the same numbers)."""
    parser.add_argument("--prompt-passes", choices=list(PROMPT_PASSES), default="auto",
                        help="how the passes run: fused (scoring: prompt passes and answer in one forward), "
                             "batched (both prompt passes as one forward over 2B rows; what fused and auto read "
                             "prompts with) or sequential (one forward per pass); every choice gives the same "
                             "numbers, only the speed differs")


def add_merge_option(parser: argparse.ArgumentParser) -> None:
    """``--no-merge``: keep PEFT's unmerged adapter layers instead of merging the causal weights for inference;
    ``--merge-bidir``: merge the bidir weights too, into a copy (:func:`merge_mode` reads them)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--no-merge", action="store_true",
                       help="keep the adapters unmerged (default: the causal weights are merged into the base "
                            "weights at load, so decoding runs at the base model's speed; the same numbers to "
                            "float rounding)")
    group.add_argument("--merge-bidir", action="store_true",
                       help="also hold the bidir weights merged, in a copy of the adapted weights (more memory), "
                            "so the second prompt pass costs what the first does; for long prompts (default: the "
                            "bidir pass adds its low-rank difference to the merged weights)")


def merge_mode(args: argparse.Namespace) -> bool | str:
    """``load_bitune``'s ``merge`` from a verb's ``--no-merge`` / ``--merge-bidir`` (:func:`bitune.config.merge_choice`)."""
    return merge_choice(args.no_merge, getattr(args, "merge_bidir", False))


def sampling_options(args: argparse.Namespace) -> dict:
    """transformers ``generate`` keywords from the sampling flags (unset flags keep the model's defaults)."""
    if not all(isinstance(s, str) and s for s in args.stop):
        raise BituneError("--stop needs a non-empty text (write --stop=TEXT for a text starting with '-')")
    for flag, low, high, closed in (("temperature", 0.0, None, False), ("top_p", 0.0, 1.0, True),
                                    ("repetition_penalty", 0.0, None, False)):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > low and (high is None or value <= high)):
            allowed = f"in ({low:g}, {high:g}]" if high is not None else f"a finite number > {low:g}"
            raise BituneError(f"--{flag.replace('_', '-')} {value}: must be {allowed}")
    if args.top_k is not None and args.top_k < 1:
        raise BituneError(f"--top-k {args.top_k}: must be >= 1")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise BituneError(f"--seed {args.seed}: must be in [0, 2**32)")
    opts = {"do_sample": args.do_sample}
    if args.do_sample:
        opts.update({k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None})
    elif any(getattr(args, k) is not None for k in ("temperature", "top_p", "top_k")):
        raise BituneError("--temperature/--top-p/--top-k only apply with --do-sample")
    if args.repetition_penalty is not None:
        opts["repetition_penalty"] = args.repetition_penalty
    return opts


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--checkpoint/--model/--base/--device/--dtype, shared with ``bitune chat`` and ``bitune plot``."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a Bitune checkpoint folder (e.g. a run's final/)")
    src.add_argument("--model", metavar="NAME", help="a base model name or folder, run untrained ('pretrained')")
    parser.add_argument("--base", metavar="NAME", help="with --checkpoint: base model to load instead of the "
                        "one the checkpoint records")
    parser.add_argument("--device", default=None, help="torch device (unset: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype: float32, bfloat16 or float16")
    add_prompt_passes_option(parser)
    add_merge_option(parser)
    add_threads_option(parser)


def model_inputs(args: argparse.Namespace) -> tuple[tuple[str, str | None], ...]:
    """What a verb with the model options reads, as :func:`bitune.files.check_output_file`'s ``keep``: the
    checkpoint, and the base model where it is a local folder (``--model``, ``--base`` or the one the checkpoint
    records; a built-in or hub name is no path)."""
    def local(name: str | None) -> str | None:
        return name if isinstance(name, str) and name.strip() and Path(name).expanduser().is_dir() else None

    base = getattr(args, "base", None)
    recorded = None
    if args.checkpoint and base is None:
        from ..checkpoint import read_config

        try:
            recorded = read_config(args.checkpoint).base_model
        except ValueError:
            pass  # the load reports what is wrong with the checkpoint
    return (("the checkpoint", args.checkpoint), ("--model", local(args.model)), ("--base", local(base)),
            ("the checkpoint's base model", local(recorded)))


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """Decoding flags, shared with ``bitune chat``."""
    parser.add_argument("--max-new-tokens", type=int, default=128, help="cap on generated tokens per answer")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, help="sampling temperature (with --do-sample)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass (with --do-sample)")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens (with --do-sample)")
    parser.add_argument("--repetition-penalty", type=float, help="transformers' repetition penalty (> 1 penalises)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop an answer at this text (repeatable); the text is cut off")
    parser.add_argument("--seed", type=int, default=None, help="random seed (sampling)")
