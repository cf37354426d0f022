"""``bitune export``: a checkpoint's decode model as a standard transformers folder (the causal weights merged),
with the checkpoint itself under ``bitune/`` for the prompt passes (see ``docs/guides/serving-at-scale.md``)."""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

from ..errors import BituneError
from ..files import check_named, check_output_dir
from ..hub import CHECKPOINT_CONFIG as CONFIG_FILE
from ..modelcard import CARD_FILE, is_ours, read_training
from .options import HelpFormatter, add_threads_option

HELP = "export a checkpoint's causal weights merged, as a plain transformers model folder"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = ("Write the causal weights merged into the base model as a standard transformers folder "
                          "(AutoModelForCausalLM.from_pretrained loads it; its generate continues a Bitune prefill "
                          "with the same tokens), plus bitune/: the checkpoint (bidir weights, mixer, config).\n"
                          "  bitune export --checkpoint runs/csqa/final --merged exported/")
    parser.add_argument("--checkpoint", required=True, metavar="DIR", help="a Bitune checkpoint folder")
    parser.add_argument("--merged", required=True, metavar="DIR",
                        help="the output folder: new, empty, or an earlier export (replaced; files an export does "
                             "not write, e.g. your README.md, are kept); never the checkpoint or its base model")
    parser.add_argument("--base", metavar="NAME", help="base model to load instead of the one the checkpoint records")
    add_threads_option(parser)


EXPORT_WRITES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                 f"model-{'[0-9]' * 5}-of-{'[0-9]' * 5}.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.txt", "special_tokens_map.json",
                 "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                 "bitune")
"""Names an export writes (the model's and the tokenizer's ``save_pretrained``, each file by its exact name, and
``bitune/``): in an earlier export, anything else (``tokenizer_notes.txt`` too) is the user's and is kept."""


def needed_models(checkpoint: str, base: str | None) -> tuple[tuple[str, str | None], ...]:
    """What the export must leave as it is, as :func:`bitune.files.check_output_dir`'s ``keep``: the checkpoint,
    ``--base`` and the base model the checkpoint records where they are local folders, and, where such a folder is
    itself an export, the base its own ``bitune/`` records (and so on down the chain)."""
    keep: list[tuple[str, str | None]] = [("--checkpoint", checkpoint)]
    todo = [("--base", base), ("the checkpoint's base model", _recorded_base(checkpoint))]
    while todo and len(keep) < 32:
        what, name = todo.pop(0)
        if name is None or not Path(name).expanduser().is_dir():
            continue
        keep.append((what, name))
        inner = Path(name).expanduser() / "bitune"
        todo.append((f"the base model of {inner}", _recorded_base(inner)))
    return tuple(keep)


def _recorded_base(folder: str | Path) -> str | None:
    """The base model a checkpoint folder records (None: not a checkpoint; a corrupt one is the load's to report)."""
    from ..checkpoint import read_config

    if not (Path(folder).expanduser() / CONFIG_FILE).is_file():
        return None
    try:
        return read_config(folder).base_model
    except ValueError:
        return None


def check_merged(merged: str, checkpoint: str, base: str | None = None) -> tuple[Path, tuple[str, ...]]:
    """The ``--merged`` folder, checked before anything loads: it is replaced, so it must be new, empty or an
    earlier export (``config.json`` and ``bitune/``), never the checkpoint, the base model it needs (or what that
    needs), a folder around them, a model or a run.

    Returns:
        The folder, and the names in it an export does not write (the user's: kept through the replacement).

    Raises:
        BituneError: naming the folder and what it holds or would destroy.
    """
    out, ckpt = Path(check_named(merged, "--merged")).resolve(), Path(check_named(checkpoint, "--checkpoint")).resolve()
    if out == ckpt or ckpt in out.parents or out in ckpt.parents:
        raise BituneError(f"--merged {merged} overlaps --checkpoint {checkpoint}: pick another folder")
    if out.exists() and not out.is_dir():
        raise BituneError(f"--merged {merged} is a file; give a folder (it is replaced whole)")
    check_output_dir(out, "--merged", keep=needed_models(checkpoint, base))
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    earlier_export = (out / "config.json").is_file() and (out / "bitune" / CONFIG_FILE).is_file()
    if held and not earlier_export:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise BituneError(f"--merged {merged} holds other files ({shown}) and is replaced by the export; give "
                          "a new or empty folder, or an earlier export")
    check_output_dir(out.parent, "--merged's parent")
    ours = {CARD_FILE} if is_ours(out / CARD_FILE) else set()  # an earlier export's card is the export's to rewrite
    return out, tuple(n for n in held if n not in ours and not any(fnmatch.fnmatchcase(n, p) for p in EXPORT_WRITES))


def say(what: str) -> None:
    """A progress line on stderr: each step of an export can take minutes on a busy machine."""
    print(f"bitune export: {what} ...", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from ..export import export_merged
    from ..loading import load_bitune

    out, kept = check_merged(args.merged, args.checkpoint, args.base)
    say(f"loading {args.checkpoint} and its base model")
    model, tokenizer = load_bitune(checkpoint=args.checkpoint, base=args.base, device="cpu")
    if model.config.variant == "pretrained":
        raise BituneError(f"{args.checkpoint} is a 'pretrained' checkpoint: the base model is its own export")
    say(f"merging the causal weights and writing {out}")
    export_merged(model, out, tokenizer, keep=kept, training=read_training(args.checkpoint))  # the card's training
    if kept:
        print(f"bitune export: kept {', '.join(kept)} in {out} (not written by an export)"
              + ("; the export's card, which says the folder alone is not the trained model, was not written over "
                 "your README.md" if CARD_FILE in kept else ""))
    print(f"bitune export: {out} (transformers model, causal weights merged) and {out / 'bitune'} (the checkpoint)")
    return 0
