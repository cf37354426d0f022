"""``bitune export``: a checkpoint's decode model as a standard transformers folder (the causal weights merged),
with the checkpoint itself under ``bitune/`` for the prompt passes (see ``docs/guides/serving-at-scale.md``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import BituneError
from ..files import check_output_dir
from .options import HelpFormatter

HELP = "export a checkpoint's causal weights merged, as a plain transformers model folder"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = ("Write the causal weights merged into the base model as a standard transformers folder "
                          "(AutoModelForCausalLM.from_pretrained loads it; its generate continues a Bitune prefill "
                          "with the same tokens), plus bitune/: the checkpoint (bidir weights, mixer, config).\n"
                          "  bitune export --checkpoint runs/csqa/final --merged exported/")
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a Bitune checkpoint folder")
    parser.add_argument("--merged", required=True, metavar="DIR", help="the output folder (replaced if it exists)")
    parser.add_argument("--base", metavar="NAME", help="base model to load instead of the one the checkpoint records")


def run(args: argparse.Namespace) -> int:
    from ..loading import load_bitune

    out, ckpt = Path(args.merged).resolve(), Path(args.checkpoint).resolve()
    if out == ckpt or ckpt in out.parents or out in ckpt.parents:
        raise BituneError(f"--merged {args.merged} overlaps --checkpoint {args.checkpoint}: pick another folder")
    check_output_dir(out.parent, "--merged's parent")
    model, tokenizer = load_bitune(checkpoint=args.checkpoint, base=args.base, device="cpu")
    if model.config.variant == "pretrained":
        raise BituneError(f"{args.checkpoint} is a 'pretrained' checkpoint: the base model is its own export")
    model.export_merged(out, tokenizer)
    print(f"bitune export: {out} (transformers model, causal weights merged) and {out / 'bitune'} (the checkpoint)")
    return 0
