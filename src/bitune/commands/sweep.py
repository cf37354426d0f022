"""``bitune sweep``: train and evaluate every method x seed from one config, then report (the paper's Table 1).

A method is a variant name from ``bitune.config.VARIANTS`` with an optional LoRA rank suffix: ``lora`` (r=8),
``lora16`` (r=16), ``bitune``, ``bitune16``, ``shared_weights``, ... or a YAML file of settings laid over the
config (its file name is the label), e.g. ``configs/methods/bitune_clip_adapters.yaml``, given by its path or,
for a packaged one, its name (``methods/bitune_clip_adapters`` or just ``bitune_clip_adapters``). ``pretrained`` is
evaluated once (it has no seed: nothing is trained). Runs go seed by seed (every method with seed 42, then 43,
...), so an interrupted sweep already holds complete pairs. Each run lives in ``OUTPUT_DIR/<method>-<seed>/``
(the trainer's ``final/``, ``log.jsonl``, ``settings.yaml`` plus ``eval.json``); runs whose ``eval.json``
exists are skipped and a finished ``final/`` is not retrained, so an interrupted sweep resumes by running the same
command again, also from a copy of the small files alone (``eval.json`` is what marks a run done). The report
is ``bitune report OUTPUT_DIR``'s (accuracies with intervals, paired differences, trivial baselines, wall time),
written to ``OUTPUT_DIR/report.{md,csv,png}``: over every run in the folder, so a second sweep into it (another
method, more seeds) extends the report instead of replacing it with its own runs. Earlier runs in the folder must
therefore be on the same splits and ``--limit`` as the sweep's; others are refused before anything trains.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

from ..config import CONFIG_FILE, VARIANTS, BituneConfig
from ..config_files import config_name, find_packaged, packaged_names
from ..errors import BituneError, closest
from ..eval.report import load_records, results_below
from ..files import check_output_dir
from ..hub import check_model_name, resolve_device
from ..records import RESULT_FILE, record_splits
from ..train import load_settings
from ..train import train as train_run
from ..train.run_folder import check_run_folder, checkpoints
from ..train.settings import read_yaml
from . import report
from .options import add_threads_option

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
    overlay: Path | None = None
    """A YAML file of settings laid over the config (instead of ``variant``/``rank``)."""

    def configs(self, base: str | None) -> list[str]:
        """The config files of this method's runs: the sweep's config, then the overlay if any."""
        return [c for c in (base, str(self.overlay) if self.overlay else None) if c]

    def overrides(self) -> list[str]:
        if self.overlay is not None:
            return []
        sets = [f"bitune.variant={self.variant}"]
        return sets + ([f"bitune.rank={self.rank}"] if self.rank is not None else [])


def parse_methods(text: str) -> list[Method]:
    """``"pretrained,lora,lora16,bitune"`` -> methods; raises a BituneError naming an unknown one."""
    methods = []
    for name in (n.strip() for n in text.split(",") if n.strip()):
        if name.endswith((".yaml", ".yml")) or "/" in name:  # a method file: local, else packaged
            methods.append(_overlay_method(Path(name)))
            continue
        m = _METHOD.match(name)
        if m and m.group(1) in VARIANTS and not (m.group(1) == "pretrained" and m.group(2)):
            methods.append(Method(name, m.group(1), int(m.group(2)) if m.group(2) else None))
            continue
        if find_packaged(f"methods/{name}") is not None:  # a packaged method file by its name
            methods.append(_overlay_method(Path(f"methods/{name}")))
            continue
        base = name.rstrip("0123456789-_")
        close, rank = closest(base, VARIANTS), name[len(base):].strip("-_")
        hint = f" (did you mean {close + (rank if close != 'pretrained' else '')!r}?)" if close else ""
        files = [n.removeprefix("methods/") for n in packaged_names() if n.startswith("methods/")]
        if not close and (close := closest(name, files, cutoff=0.8)):
            hint = f" (did you mean {close!r}, the packaged method file?)"
        raise BituneError(f"unknown method {name!r}{hint}: use a variant ({', '.join(VARIANTS)}) with an optional "
                          "rank suffix, e.g. lora16, a packaged method file by its name ('bitune configs list': "
                          "methods/...), or a method file's path")
    if not methods:
        raise BituneError("--methods is empty")
    labels = [m.label for m in methods]
    if len(set(labels)) != len(labels):  # one run would count twice in the report
        raise BituneError(f"--methods names {next(x for x in labels if labels.count(x) > 1)!r} twice")
    return methods


def _overlay_method(path: Path) -> Method:
    data = read_yaml(path)
    section = data.get("bitune") if isinstance(data.get("bitune"), dict) else {}
    variant = section.get("variant", BituneConfig.variant)
    if variant == "pretrained":
        raise BituneError(f"method file {path}: variant 'pretrained' trains nothing; use the method 'pretrained'")
    return Method(config_name(path.name), str(variant), None, path)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as e:
        raise BituneError(f"--seeds must be comma-separated integers, got {text!r}") from e
    if not seeds:
        raise BituneError("--seeds is empty")
    bad = [s for s in seeds if not 0 <= s < 2**32]
    if bad:  # found now, not after the runs of the seeds before it
        raise BituneError(f"--seeds: {bad[0]} is not a seed (must be in [0, 2**32))")
    if len(set(seeds)) != len(seeds):  # the same run would count as two seeds, with zero spread
        raise BituneError(f"--seeds names {next(x for x in seeds if seeds.count(x) > 1)} twice")
    return seeds


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Train each method with each seed from one training config, evaluate every run with "
                          "'bitune eval', and aggregate with 'bitune report'. Example:\n  bitune sweep --config "
                          "tasks/piqa.yaml --methods pretrained,lora,lora16,bitune --seeds 42,43,44 "
                          "--tasks piqa --output-dir runs/piqa-sweep")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="training config (as for 'bitune train': a file or a packaged config's name)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="training setting override for every run (repeatable), e.g. --set steps=100")
    parser.add_argument("--methods", default="pretrained,lora,lora16,bitune",
                        help="comma-separated variants with optional rank suffix, or YAML files of settings laid "
                             "over the config (labelled by file name): a path, or a packaged method file's name "
                             "(e.g. bitune_clip_adapters; 'bitune configs list')")
    parser.add_argument("--seeds", default="42,43,44", help="comma-separated training seeds")
    parser.add_argument("--tasks", default="piqa,arc_challenge,csqa,siqa,mmlu", help="evaluation tasks")
    parser.add_argument("--split", default=None, metavar="SPLIT",
                        help="evaluation split: 'reported' (default), 'tuning' (for a learning-rate sweep) or a "
                             "split name, as for 'bitune eval'")
    parser.add_argument("--limit", type=int, help="evaluate only the first N questions per task")
    parser.add_argument("--batch-size", type=int, default=8, help="evaluation rows per forward pass")
    parser.add_argument("--device", default=None, help="evaluation device (default: cuda if available)")
    parser.add_argument("--output-dir", required=True, metavar="DIR", help="one subfolder per run, plus the report")
    parser.add_argument("--metric", default="acc", choices=("acc", "acc_norm"), help="metric in the report")
    add_threads_option(parser)


def evaluate_run(**kwargs) -> dict | None:
    """:func:`bitune.eval.evaluate.evaluate_run`, imported when a run is evaluated (lm-eval: the ``eval`` extra,
    whose absence :func:`run` reports before anything trains)."""
    from ..eval.evaluate import evaluate_run as evaluate

    return evaluate(**kwargs)


def check_done(result: Path, splits: dict[str, str], limit: int | None, model: str | None = None) -> bool:
    """Whether ``result`` (a run's ``eval.json``) exists and holds this sweep's tasks (``{task: split}``) and
    ``--limit`` (and base ``model``, when given); one that holds others is an error (a report from it would show
    other questions, or another model, than asked for). A record without ``splits`` was made on the reported
    splits."""
    if not result.is_file():
        return False
    record = load_records([result])[0]
    if model is not None and record["config"].get("model") != model:
        raise BituneError(f"{result} holds an evaluation of the base model {record['config'].get('model')!r}; "
                          f"this sweep trains {model!r}. Use another --output-dir")
    done, was = record_splits(record), record["config"].get("limit")
    if done != splits or was != limit:
        def say(s: dict[str, str]) -> str:
            return ", ".join(f"{t} ({s[t]})" for t in sorted(s))
        raise BituneError(f"{result} holds an evaluation of {say(done)} with --limit {was}; this sweep asks for "
                          f"{say(splits)} with --limit {limit}. Use another --output-dir, or delete that "
                          "eval.json to evaluate the run again")
    return True


def earlier_runs(out: Path, planned: list[Path], splits: dict[str, str], limit: int | None,
                 model: str) -> list[Path]:
    """The other ``eval.json`` files the folder's report reads (``bitune report OUTPUT_DIR``: every one below it, or
    the folders its ``report.yaml`` names), beside the sweep's own runs. Each must be of the sweep's base ``model``
    and hold this sweep's split of every task the two share, and its ``--limit``: the report pools them with the
    sweep's runs, and would otherwise mix other questions or another model in (or fail after the training)."""
    own = {p.resolve() for p in planned}
    files = [f for f in results_below(out) if f.resolve() not in own]
    for f, record in zip(files, load_records(files)):
        if record["config"].get("model") != model:
            raise BituneError(f"{out} holds {f}, a run of the base model {record['config'].get('model')!r}; this "
                              f"sweep trains {model!r}, and its report covers every run in its folder and must "
                              "not pool them. Use another --output-dir")
        done, was = record_splits(record), record["config"].get("limit")
        clash = sorted(t for t in done.keys() & splits.keys() if done[t] != splits[t])
        if clash or was != limit:
            what = (f"{clash[0]} on its {done[clash[0]]} split, this sweep on {splits[clash[0]]}" if clash
                    else f"--limit {was}, this sweep {limit}")
            raise BituneError(f"{out} holds {f}, evaluated with {what}; the sweep's report covers every run in "
                              "its folder and must not pool them. Use another --output-dir")
    return files


def run_settings(args: argparse.Namespace, method: Method, seed: int, run_dir: Path):
    """The training settings of one run (the config, the method's overlay or variant, the seed, the run's folder),
    read before any run trains, so a bad setting of a later method stops the sweep before the first.

    Raises:
        BituneError: a setting is invalid (naming the method's file, when the method is one).
    """
    try:
        return load_settings(method.configs(args.config),
                             [*args.overrides, *method.overrides(), f"seed={seed}", f"output_dir={run_dir}"])
    except BituneError as e:
        if method.overlay is None or str(method.overlay) in str(e):
            raise
        raise BituneError(f"method file {method.overlay}: {e}") from e


def check_start(run_dir: Path, settings) -> tuple[bool, bool] | None:
    """How the sweep starts the run in ``run_dir``: None when its ``final/`` is there (only evaluated), else
    ``(resume, restart)``: an unfinished run with a checkpoint is resumed, one without is started again. Checked
    before the sweep's first run (:func:`bitune.train.run_folder.check_run_folder`): a run that cannot resume
    (settings other than the saved run's, no complete checkpoint) stops the sweep before anything trains.

    Raises:
        BituneError: naming the run folder and why it cannot be resumed or restarted.
    """
    if (run_dir / "final" / CONFIG_FILE).is_file():
        return None
    resume = bool(checkpoints(run_dir))  # complete ones: a run cut while saving its first starts again
    restart = not resume and run_dir.exists()
    try:
        check_run_folder(run_dir, settings, resume, overwrite=restart)
    except BituneError as e:
        raise BituneError(f"{run_dir} holds an unfinished run, which the sweep resumes: "
                          f"{str(e).removeprefix('--resume: ')}") from e
    return resume, restart


def run(args: argparse.Namespace) -> int:
    from ..eval.evaluate import check_eval_options, quiet_lm_eval  # lm-eval (the eval extra): before anything trains
    from ..eval.tasks import PREFIX, make_tasks, task_split

    methods, seeds = parse_methods(args.methods), parse_seeds(args.seeds)
    check_eval_options(args.limit, args.batch_size)  # before anything trains
    base_model = load_settings(args.config, args.overrides).model  # validates the config up front
    check_model_name(base_model)
    resolve_device(args.device)  # the evaluations' device, checked before the first run trains
    with quiet_lm_eval():
        splits = {t.config.task.removeprefix(PREFIX): task_split(t) for t in make_tasks(args.tasks, args.split)}
    out = check_output_dir(args.output_dir, "--output-dir")
    plan = [(m, None) for m in methods if m.variant == "pretrained"]
    plan += [(m, seed) for seed in seeds for m in methods if m.variant != "pretrained"]
    results = [out / (m.label if seed is None else f"{m.label}-{seed}") / RESULT_FILE for m, seed in plan]
    earlier = earlier_runs(out, results, splits, args.limit, base_model)  # before anything trains
    report.check_outputs(out, "--output-dir")  # the report it ends with replaces no file of the user's
    done = [check_done(result, splits, args.limit, base_model) for result in results]  # every run's eval.json, read now
    settings = [None if seed is None else run_settings(args, method, seed, result.parent)
                for (method, seed), result in zip(plan, results)]  # every run's settings, checked now
    starts = [None if prepared is None or finished else check_start(result.parent, prepared)
              for result, finished, prepared in zip(results, done, settings)]  # every earlier run's folder, now
    for (method, seed), result, finished, prepared, start in zip(plan, results, done, settings, starts):
        run_dir = result.parent
        if finished:
            print(f"bitune sweep: {run_dir} already evaluated, skipped")
            continue
        if seed is None:
            evaluate_run(model_name=base_model, tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
                         device=args.device, label=method.label, output=result, split=args.split)
            continue
        final = run_dir / "final"
        if start is not None:
            resume, restart = start
            if restart:  # an interrupted run with nothing to resume: the trainer replaces its own files only
                print(f"bitune sweep: {run_dir} holds an unfinished run without a checkpoint; starting it again")
            print(f"bitune sweep: training {method.label} seed {seed} -> {run_dir}")
            # train's own --overwrite: under the run's lock (never a run in progress), once the model and data
            # have loaded, and only what a run writes (checkpoints, final/, log, settings), not other files
            train_run(prepared, resume=resume, overwrite=restart)
        evaluate_run(checkpoint=str(final), tasks=args.tasks, limit=args.limit, batch_size=args.batch_size,
                     device=args.device, label=method.label, output=result, split=args.split)
    # 'bitune report OUTPUT_DIR': the folder's runs, earlier sweeps' with this one's
    parser = argparse.ArgumentParser(prog="bitune report")
    report.configure(parser)
    return report.run(parser.parse_args([*map(str, earlier + results), "--output", str(out), "--metric", args.metric]))
