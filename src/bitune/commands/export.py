"""``bitune export``: a checkpoint's decode model as a standard transformers folder (the causal weights merged),
with the checkpoint itself under ``bitune/`` for the prompt passes (see ``docs/guides/serving-at-scale.md``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import BituneError
from ..files import check_named, check_output_dir
from ..hub import CHECKPOINT_CONFIG as CONFIG_FILE
from .options import HelpFormatter

HELP = "export a checkpoint's causal weights merged, as a plain transformers model folder"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = ("Write the causal weights merged into the base model as a standard transformers folder "
                          "(AutoModelForCausalLM.from_pretrained loads it; its generate continues a Bitune prefill "
                          "with the same tokens), plus bitune/: the checkpoint (bidir weights, mixer, config).\n"
                          "  bitune export --checkpoint runs/csqa/final --merged exported/")
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a Bitune checkpoint folder")
    parser.add_argument("--merged", required=True, metavar="DIR", help="the output folder: new, empty, or an earlier export (which is replaced)")
    parser.add_argument("--base", metavar="NAME", help="base model to load instead of the one the checkpoint records")


def check_merged(merged: str, checkpoint: str) -> Path:
    """The ``--merged`` folder, checked before anything loads: it is replaced whole, so it must be new, empty or an
    earlier export (``config.json`` and ``bitune/``), never the checkpoint, a folder around it, a model or a run.

    Raises:
        BituneError: naming the folder and what it holds.
    """
    out, ckpt = Path(check_named(merged, "--merged")).resolve(), Path(check_named(checkpoint, "--checkpoint")).resolve()
    if out == ckpt or ckpt in out.parents or out in ckpt.parents:
        raise BituneError(f"--merged {merged} overlaps --checkpoint {checkpoint}: pick another folder")
    if out.exists() and not out.is_dir():
        raise BituneError(f"--merged {merged} is a file; give a folder (it is replaced whole)")
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    earlier_export = (out / "config.json").is_file() and (out / "bitune" / CONFIG_FILE).is_file()
    if held and not earlier_export:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise BituneError(f"--merged {merged} holds other files ({shown}) and is replaced whole by the export; give "
                          "a new or empty folder, or an earlier export")
    check_output_dir(out.parent, "--merged's parent")
    return out


def run(args: argparse.Namespace) -> int:
    from ..loading import load_bitune

    out = check_merged(args.merged, args.checkpoint)
    model, tokenizer = load_bitune(checkpoint=args.checkpoint, base=args.base, device="cpu")
    if model.config.variant == "pretrained":
        raise BituneError(f"{args.checkpoint} is a 'pretrained' checkpoint: the base model is its own export")
    model.export_merged(out, tokenizer)
    print(f"bitune export: {out} (transformers model, causal weights merged) and {out / 'bitune'} (the checkpoint)")
    return 0
