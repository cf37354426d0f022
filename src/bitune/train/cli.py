"""``bitune train --config FILE.yaml [--set key=value ...] [--resume]``: train a Bitune model or a baseline."""

from __future__ import annotations

import argparse

from ..config import BituneConfig
from .settings import TrainSettings, field_docs, load_settings

HELP = "train a Bitune model or a baseline from a YAML config"


class _Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    pass


def settings_help() -> str:
    """The list of every setting with its default and docstring, for ``--help``."""
    defaults = TrainSettings().to_dict()
    lines = ["settings (YAML keys, or --set key=value):"]
    for name, doc in field_docs(TrainSettings).items():
        if name == "bitune":
            continue
        lines.append(f"  {name} = {defaults[name]!r}\n      {doc}")
    lines.append("  bitune: the model section (--set bitune.KEY=VALUE)")
    for name, doc in field_docs(BituneConfig).items():
        lines.append(f"    bitune.{name} = {defaults['bitune'][name]!r}\n        {doc}")
    lines.append("\nA config may start with 'extends: other.yaml' to inherit and override another file.\n"
                 "Outputs in output_dir: settings.yaml, log.jsonl, tensorboard/, checkpoint-N/, final/.")
    return "\n".join(lines).replace("``", "'")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _Formatter
    parser.description = ("Train a Bitune model or a baseline (variant, method and hyperparameters from a YAML "
                          "config plus overrides). Examples:\n  bitune train --config configs/quickstart.yaml\n"
                          "  bitune train --config configs/tasks/piqa.yaml --set seed=43\n"
                          "  bitune train --config configs/tasks/piqa.yaml --config configs/methods/lora16.yaml")
    parser.epilog = settings_help()
    parser.add_argument("--config", action="append", metavar="FILE.yaml",
                        help="YAML file of settings (see below); repeat to merge several in order, e.g. a task "
                             "then configs/methods/lora16.yaml; omitted: the defaults")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. --set lr=1e-3 --set bitune.rank=16 (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in output_dir (same settings)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the settings, print them resolved and exit without training")


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, args.overrides)
    if args.dry_run:
        print(settings.to_yaml(), end="")
        return 0
    from .recipe import train

    train(settings, resume=args.resume)
    return 0
