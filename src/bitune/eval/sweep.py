"""``bitune sweep``: train and evaluate every method x seed from one config, then report (the paper's Table 1).

A method is a variant name from ``bitune.config.VARIANTS`` with an optional LoRA rank suffix: ``lora`` (r=8),
``lora16`` (r=16), ``bitune``, ``bitune16``, ``shared_weights``, ... ``pretrained`` is evaluated once (it has no
seed: nothing is trained). Each run lives in ``OUTPUT_DIR/<method>-<seed>/`` (the trainer's ``final/`` plus
``eval.json``); runs whose ``eval.json`` exists are skipped and a finished ``final/`` is not retrained, so an
interrupted sweep resumes by running the same command again. The report goes to ``OUTPUT_DIR/report.{md,csv}``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import BituneError

HELP = "train and evaluate methods x seeds, then report"
_METHOD = re.compile(r"^([a-z_]+?)(\d+)?$")


@dataclass(frozen=True)
class Method:
    """One row of the table."""

    label: str
    """Name as given, e.g. ``lora16``."""
    variant: str
    """``BituneConfig.variant``."""
    rank: int | None
    """LoRA rank override (None: the config's)."""

    def overrides(self) -> list[str]:
        sets = [f"bitune.variant={self.variant}"]
        return sets + ([f"bitune.rank={self.rank}"] if self.rank is not None else [])


def parse_methods(text: str) -> list[Method]:
    """``"pretrained,lora,lora16,bitune"`` -> methods; raises a BituneError naming an unknown one."""
    from ..config import VARIANTS

    methods = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        m = _METHOD.match(name)
        if not m or m.group(1) not in VARIANTS or (m.group(1) == "pretrained" and m.group(2)):
            raise BituneError(f"unknown method {name!r}: use a variant ({', '.join(VARIANTS)}) with an optional "
                              "rank suffix, e.g. lora16")
        methods.append(Method(name, m.group(1), int(m.group(2)) if m.group(2) else None))
    if not methods:
        raise BituneError("--methods is empty")
    return methods


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise BituneError(f"--seeds must be comma-separated integers, got {text!r}") from e
    if not seeds:
        raise BituneError("--seeds is empty")
    return seeds


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Train each method with each seed from one training config, evaluate every run with "
                          "'bitune eval', and aggregate with 'bitune report'. Example:\n  bitune sweep --config "
                          "configs/tasks/piqa.yaml --methods pretrained,lora,lora16,bitune --seeds 42,43,44 "
                          "--tasks piqa --output-dir runs/piqa-sweep")
    parser.add_argument("--config", metavar="FILE.yaml", help="training config (as for 'bitune train')")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="training setting override for every run (repeatable), e.g. --set steps=100")
    parser.add_argument("--methods", default="pretrained,lora,lora16,bitune",
                        help="comma-separated variants with optional rank suffix")
    parser.add_argument("--seeds", default="42,43,44", help="comma-separated training seeds")
    parser.add_argument("--tasks", default="piqa,arc_challenge,csqa,siqa,mmlu", help="evaluation tasks")
    parser.add_argument("--limit", type=int, help="evaluate only the first N questions per task")
    parser.add_argument("--batch-size", type=int, default=8, help="evaluation rows per forward pass")
    parser.add_argument("--device", default=None, help="evaluation device (default: cuda if available)")
    parser.add_argument("--output-dir", required=True, metavar="DIR", help="one subfolder per run, plus the report")
    parser.add_argument("--metric", default="acc", choices=("acc", "acc_norm"), help="metric in the report")


def run(args: argparse.Namespace) -> int:
    from ..train import load_settings
    from ..train import train as train_run
    from .cli import RESULT_FILE, evaluate_run
    from .report import aggregate, load_records, print_report, write_report
    from .tasks import make_tasks

    methods, seeds = parse_methods(args.methods), parse_seeds(args.seeds)
    make_tasks(args.tasks)
    out = Path(args.output_dir)
    base_model = load_settings(args.config, args.overrides).model  # validates the config up front
    results: list[Path] = []
    for method in methods:
        for seed in ([None] if method.variant == "pretrained" else seeds):
            run_dir = out / (method.label if seed is None else f"{method.label}-{seed}")
            result = run_dir / RESULT_FILE
            results.append(result)
            if result.is_file():
                print(f"bitune sweep: {run_dir} already evaluated, skipped")
                continue
            if seed is None:
                evaluate_run(model_name=base_model, tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
                             device=args.device, label=method.label, output=result)
                continue
            final = run_dir / "final"
            if not (final / "bitune_config.json").is_file():
                settings = load_settings(args.config, [*args.overrides, *method.overrides(), f"seed={seed}",
                                                       f"output_dir={run_dir}"])
                print(f"bitune sweep: training {method.label} seed {seed} -> {run_dir}")
                train_run(settings)
            evaluate_run(checkpoint=str(final), tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
                         device=args.device, label=method.label, output=result)
    report = aggregate(load_records(results), args.metric)
    print_report(report, f"{args.metric}, mean ± std over seeds {seeds}, %")
    md, cs = write_report(report, out)
    print(f"bitune sweep: wrote {md} and {cs}")
    return 0
