"""The mechanism of a study task, drawn from its runs' training logs (study part 4, issue 40 item 7).

    python scripts/study_figures.py results/qwen2.5-arc-easy-csqa/arc_easy      # <folder>/training.png and .md

Left: the training loss over steps of each trained method (the mean over its seeds of each logged step's loss,
which is the mean over the steps since the previous record). Right: the mean over layers of the bidirectional
share a_k (solid) and a_v (dashed) of each method that mixes, from its start (``bitune.init_share``, 0.5 by
default) to its last step. Runs are the subfolders ``<method>-<seed>`` holding a ``log.jsonl`` of a finished training (one
with its ``train_runtime`` record); a run still training is left out.

``training.md`` holds the same logs as numbers, per run: its training loss minus that of ``lora`` at the same
seed (the same batches) averaged over the logged steps of each window, the share of logged steps after step 100
where it is above, and the mean bidirectional share of keys and values at its lowest and at its last step.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
from matplotlib.figure import Figure

from bitune.cli import run_script
from bitune.errors import BituneError
from bitune.files import check_output_file, read_text, write_text_atomic
from bitune.plot import read_mixing_log

RUN = re.compile(r"^(?P<method>.+)-(?P<seed>\d+)$")


class Run(NamedTuple):
    """One finished training: its log file and its logged steps (the records with a training loss)."""

    method: str
    seed: int
    log: Path
    steps: list[dict]


def runs(folder: Path) -> dict[tuple[str, int], Run]:
    """The finished runs under ``folder``, ``{(method, seed): Run}``: subfolders ``<method>-<seed>`` whose
    ``log.jsonl`` holds the ``train_runtime`` record that ends a training. A run still training (or cut off) is left
    out, so that its seed never joins a mean part-way."""
    out = {}
    for log in sorted(folder.glob("*/log.jsonl")):
        match = RUN.match(log.parent.name)
        if match is None:
            continue
        records = log_records(log)
        if not any("train_runtime" in r for r in records):
            print(f"study figures: {log.parent.name} has not finished training, left out", file=sys.stderr)
            continue
        steps = [r for r in records if "loss" in r and r.get("step") and "train_runtime" not in r]
        out[match["method"], int(match["seed"])] = Run(match["method"], int(match["seed"]), log, steps)
    return out


def log_records(log: Path) -> list[dict]:
    """The records of a training log; a last line cut off (a run stopped while writing it) is left out, as the run
    is (it has no ``train_runtime`` record after it).

    Raises:
        BituneError: a line before the last is not JSON (naming ``log:line``), or the file cannot be read.
    """
    lines = [line for line in read_text(log, "training log").splitlines() if line.strip()]
    records = []
    for n, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n < len(lines):
                raise BituneError(f"{log}:{n}: not valid JSON ({e.msg})") from e
    return records


def curves(found: dict[tuple[str, int], Run]) -> tuple[dict, dict]:
    """Per method, ``{step: [loss per seed]}`` and ``{"k"|"v": {step: [mean a per seed]}}``; the shares are
    ``bitune.plot.read_mixing_log``'s, which start at step 0 with the run's initial share."""
    loss: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    share: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: {"k": defaultdict(list),
                                                                               "v": defaultdict(list)})
    for run in found.values():
        for record in run.steps:
            loss[run.method][record["step"]].append(float(record["loss"]))
        if any("a_k" in r for r in run.steps):
            steps, ratios = read_mixing_log(run.log)
            for key in ("k", "v"):
                for step, per_layer in zip(steps, ratios[key]):
                    share[run.method][key][step].append(float(np.mean(per_layer)))
    return loss, share


WINDOWS = ((1, 50), (51, 100), (101, None))


def dynamics(folder: Path, found: dict[tuple[str, int], Run] | None = None) -> str:
    """The mechanism as a markdown table: each run against ``lora`` at its seed, over step windows."""
    found = {key: run.steps for key, run in (runs(folder) if found is None else found).items()}
    header = ["run"] + [f"loss - lora, steps {lo}-{hi or 'end'}" for lo, hi in WINDOWS]
    header += ["above lora after step 100", "a_k lowest", "a_k last", "a_v last"]
    rows = []
    for (method, seed), records in sorted(found.items()):
        base = {r["step"]: r["loss"] for r in found.get(("lora", seed), [])}
        if method == "lora":
            continue
        end = max(base, default=0)
        cells = [f"{method}-{seed}"]
        for lo, hi in WINDOWS:
            gaps = [r["loss"] - base[r["step"]] for r in records
                    if r["step"] in base and lo <= r["step"] <= (hi or end)]
            cells.append(f"{np.mean(gaps):+.3f}" if gaps else "-")
        late = [r["loss"] > base[r["step"]] for r in records if r["step"] in base and r["step"] > 100]
        cells.append(f"{sum(late)}/{len(late)}" if late else "-")
        mean_k = [float(np.mean(r["a_k"])) for r in records if "a_k" in r]
        mean_v = [float(np.mean(r["a_v"])) for r in records if "a_v" in r]
        cells += [f"{min(mean_k):.2f}", f"{mean_k[-1]:.2f}", f"{mean_v[-1]:.2f}"] if mean_k else ["-"] * 3
        rows.append(cells)
    lines = [f"# {folder.name}: training dynamics against `lora` at the same seed",
             "",
             "Made by `scripts/study_figures.py` from each finished run's `log.jsonl` (a logged step's loss is the",
             "mean over the steps since the previous record; windows end at `lora`'s last step). `lora_compute`'s",
             "learning-rate schedule is longer, so it is not at `lora`'s rate at the same step.",
             "",
             "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def figure(folder: Path, found: dict[tuple[str, int], Run] | None = None) -> Path:
    loss, share = curves(runs(folder) if found is None else found)
    if not loss:
        raise SystemExit(f"study figures: no <method>-<seed>/log.jsonl with losses under {folder}")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    left, right = fig.subplots(1, 2)
    colors = {}
    for i, (method, by_step) in enumerate(sorted(loss.items())):
        steps = sorted(by_step)
        seeds = max(len(v) for v in by_step.values())
        line, = left.plot(steps, [np.mean(by_step[s]) for s in steps], linewidth=1.2,
                          label=f"{method} ({seeds} seed{'s' if seeds > 1 else ''})")
        colors[method] = line.get_color()
    left.set_xlabel("training step")
    left.set_ylabel("training loss (answer tokens)")
    left.set_yscale("log")
    left.grid(alpha=0.3)
    left.legend(fontsize=8)
    left.set_title("Training loss, mean over seeds")
    for method, by_key in sorted(share.items()):
        for key, style in (("k", "-"), ("v", "--")):
            steps = sorted(by_key[key])
            right.plot(steps, [np.mean(by_key[key][s]) for s in steps], style, color=colors.get(method),
                       linewidth=1.2, label=f"{method} $a_{key}$")
    right.set_xlabel("training step")
    right.set_ylabel("bidirectional share a, mean over layers")
    right.set_ylim(0, 1)
    right.grid(alpha=0.3)
    if share:
        right.legend(fontsize=8)
    right.set_title("Mixing: the bidirectional share over training")
    fig.suptitle(f"{folder.name}: how the methods train")
    out = folder / "training.png"
    fig.savefig(out, dpi=110)
    return out


def main(folder: Path) -> int:
    """Write ``folder/training.png`` and ``folder/training.md``; both targets are checked before any work."""
    if not folder.is_dir():
        raise BituneError(f"{folder}: not a folder")
    for name in ("training.png", "training.md"):
        check_output_file(folder / name, "study figures' output")
    table = folder / "training.md"
    found = runs(folder)
    print(figure(folder, found))
    write_text_atomic(table, dynamics(folder, found))
    print(table)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(run_script("study figures", lambda: main(Path(sys.argv[1]))))
