"""``bitune train --config FILE.yaml [--set key=value ...] [--resume] [--num-processes N]``: train a Bitune model
or a baseline, in one process or data-parallel in N (re-launched through ``torch.distributed.run``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import config
from ..config import BituneConfig
from ..data.datasets import DATASETS
from ..errors import BituneError
from ..files import check_output_dir
from ..hub import BUILTIN_MODELS, check_model_name
from ..processes import check_fsdp_processes, world_size
from ..train.run_folder import check_run_folder
from ..train.settings import TrainSettings, field_docs, load_settings
from .launcher import launch
from .options import HelpFormatter, add_threads_option

HELP = "train a Bitune model or a baseline from a YAML config"


def _named_values() -> dict[str, str]:
    """What the field docstrings refer to by name (``VARIANTS``, ...), spelled out for ``--help``."""
    values = {"VARIANTS": config.VARIANTS, "METHODS": config.METHODS, "TEMPLATES": getattr(config, "TEMPLATES", {}),
              "bitune.config.PROMPT_PASSES": config.PROMPT_PASSES, "bitune.data.datasets.DATASETS": DATASETS,
              "bitune.hub.list_models": BUILTIN_MODELS}
    return {f"``{k}``": ", ".join(v) for k, v in values.items() if v}


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
                 "Outputs in output_dir: settings.yaml, log.jsonl, tensorboard/, checkpoint-N/, final/, run.lock.")
    text = "\n".join(lines)
    for name, value in _named_values().items():
        text = text.replace(name, f"[{value}]")
    return text.replace("``", "'")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = ("Train a Bitune model or a baseline (variant, method and hyperparameters from a YAML "
                          "config plus overrides). A config is a local file or, failing that, a packaged "
                          "config by name ('bitune configs list'). Examples:\n"
                          "  bitune train --config quickstart.yaml\n"
                          "  bitune train --config tasks/piqa.yaml --set seed=43\n"
                          "  bitune train --config tasks/piqa.yaml --config methods/lora16.yaml\n"
                          "  bitune train --config tasks/piqa.yaml --num-processes 2   # data-parallel (DDP)\n"
                          "  bitune train --config tasks/piqa.yaml --num-processes 2 --fsdp   # sharded (FSDP2)\n"
                          "batch_size is per process: N processes give a global batch of N x batch_size x "
                          "grad_accum.")
    parser.epilog = settings_help()
    parser.add_argument("--config", action="append", metavar="FILE.yaml",
                        help="YAML file of settings (see below), or a packaged config's name (methods/lora16); "
                             "repeat to merge several in order, e.g. a task then methods/lora16.yaml; omitted: the "
                             "defaults")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. --set lr=1e-3 --set bitune.rank=16 (repeatable)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest complete checkpoint in output_dir (same settings); an error "
                             "when there is none or the run has finished")
    parser.add_argument("--overwrite", action="store_true",
                        help="allow replacing what output_dir holds: with --resume, continue a finished run from its "
                             "newest checkpoint and replace final/; without, delete the old run (checkpoints, "
                             "final/, log; other files are kept) and start afresh. Refused when the base model or the data "
                             "lies in the run's checkpoints or final/")
    parser.add_argument("--num-processes", type=int, default=1, metavar="N",
                        help="train data-parallel in N processes on this machine (one per GPU; gloo on CPU), "
                             "launched through torch.distributed.run; not needed under torchrun/accelerate launch")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard parameters, gradients and optimizer state over the processes (FSDP2) instead of "
                             "replicating them (DDP); the same as --set fsdp=true")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the settings (and that output_dir can be written), load the model and run "
                             "wrap's checks on it as the run would, print the settings resolved and exit without "
                             "training")
    add_threads_option(parser)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, args.overrides + (["fsdp=true"] if args.fsdp else []))
    settings.check_dataset()
    check_model_name(settings.model)  # a misspelt built-in, a missing folder, a checkpoint: before anything loads
    check_output_dir(settings.output_dir, "output_dir")
    if args.dry_run:  # refused as the run would refuse it (the run checks again, under its lock)
        check_run_folder(Path(settings.output_dir), settings, args.resume, args.overwrite)
        from ..hub import load_model
        from ..model import BituneModel

        BituneModel.wrap(load_model(settings.model)[0], settings.bitune)  # the model: wrap's checks, as the run's
        print(settings.to_yaml(), end="")
        return 0
    if args.num_processes < 1:
        raise BituneError(f"--num-processes must be >= 1, got {args.num_processes}")
    if settings.fsdp:
        check_fsdp_processes(max(args.num_processes, world_size()))
    if args.num_processes > 1:
        return launch(args.num_processes, train_argv(args))
    from ..train.recipe import train  # torch: here, so that help stays light

    train(settings, resume=args.resume, overwrite=args.overwrite)  # takes the run folder first (start_run)
    return 0


def train_argv(args: argparse.Namespace) -> list[str]:
    """The ``bitune train`` arguments each launched process runs with (everything but ``--num-processes``)."""
    argv = ["train"]
    for path in args.config or []:
        argv += ["--config", path]
    for override in args.overrides:
        argv += ["--set", override]
    if args.threads is not None:
        argv += ["--threads", str(args.threads)]
    if args.fsdp:
        argv += ["--fsdp"]
    return argv + (["--resume"] if args.resume else []) + (["--overwrite"] if args.overwrite else [])

