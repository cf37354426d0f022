"""``bitune plot``: the paper's figures of a run (mixing ratios, fig. 2-3) and of a checkpoint (prompt attention
maps, A.12), drawn by :mod:`bitune.plot`."""

from __future__ import annotations

import argparse
import sys

from ..config import TEMPLATES
from ..errors import BituneError
from ..files import check_output_dir, check_replaces_own, check_text, is_figure
from ..generation import pick_template
from ..loading import load_bitune
from ..plot import ATTENTION_FILE, FINAL_FILE, STEPS_FILE, plot_attention, plot_mixing
from .options import add_model_options, merge_mode

HELP = "plot mixing ratios over training and attention maps"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Plot the paper's figures. Examples:\n"
                          "  bitune plot mixing --log runs/alpaca/log.jsonl --output figures/\n"
                          "  bitune plot attention --checkpoint runs/gsm8k/final --prompt 'What is 2+3?' "
                          "--output figures/")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="figure", metavar="FIGURE", required=True)
    mixing = sub.add_parser("mixing", help="a_k and a_v per layer over training and after it (paper fig. 2-3)",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    mixing.add_argument("--log", required=True, metavar="RUN/log.jsonl", help="a training run's log")
    mixing.add_argument("--output", required=True, metavar="DIR", help=f"folder for {STEPS_FILE} and {FINAL_FILE}")
    attention = sub.add_parser("attention", help="causal vs bidirectional prompt attention maps (paper A.12)",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_options(attention)
    attention.add_argument("--prompt", required=True, help="the prompt to read")
    attention.add_argument("--template", choices=list(TEMPLATES), default=None,
                           help="how the prompt is wrapped (default: the template the checkpoint was trained with; "
                                "for a base model its chat template if it has one, else paper)")
    attention.add_argument("--max-labels", type=int, default=40, help="label the axes with tokens up to this length")
    attention.add_argument("--output", required=True, metavar="DIR", help=f"folder for {ATTENTION_FILE}")


def run(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: F401  (the plot extra: missing, it is named before any work)

    if args.figure == "attention" and args.max_labels < 0:
        raise BituneError(f"--max-labels must be >= 0 (0: no token labels), got {args.max_labels}")
    if args.figure == "attention":  # the rule generate applies to a prompt
        if not args.prompt.strip():
            raise BituneError("--prompt is empty")
        check_text(args.prompt, "--prompt")
    out = check_output_dir(args.output, "--output")  # before the model loads
    for name in (STEPS_FILE, FINAL_FILE) if args.figure == "mixing" else (ATTENTION_FILE,):
        check_replaces_own(out / name, "--output", "a figure written by bitune plot", is_figure, form="bytes")
    if args.figure == "mixing":
        paths = plot_mixing(args.log, args.output)
    else:
        model, tokenizer = load_bitune(args.checkpoint, args.model, args.base, args.dtype, args.device,
                                       args.prompt_passes, merge=merge_mode(args))
        template, why = pick_template(model, tokenizer, args.template)
        print(f"bitune plot: {template} template ({why})", file=sys.stderr)
        paths = [plot_attention(model, tokenizer, args.prompt, args.output, template, args.max_labels)]
    for p in paths:
        print(f"bitune plot: wrote {p}")
    return 0
