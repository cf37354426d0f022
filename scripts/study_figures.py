"""The mechanism of a study task, drawn from its runs' training logs (study part 4, issue 40 item 7).

    python scripts/study_figures.py results/qwen2.5-arc-easy-csqa/arc_easy      # writes <folder>/training.png

Left: the training loss over steps of each trained method (the mean over its seeds of each logged step's loss,
which is the mean over the steps since the previous record). Right: the mean over layers of the bidirectional
share a_k (solid) and a_v (dashed) of each method that mixes, from its start (``bitune.init_share``, 0.5 by
default) to its last step. Runs are the subfolders ``<method>-<seed>`` holding a ``log.jsonl`` of a finished training (one
with its ``train_runtime`` record); a run still training is left out.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from bitune.plot import read_mixing_log

RUN = re.compile(r"^(?P<method>.+)-(?P<seed>\d+)$")


def curves(folder: Path) -> tuple[dict, dict]:
    """Per method, ``{step: [loss per seed]}`` and ``{"k"|"v": {step: [mean a per seed]}}``."""
    loss: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    share: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: {"k": defaultdict(list),
                                                                               "v": defaultdict(list)})
    for log in sorted(folder.glob("*/log.jsonl")):
        match = RUN.match(log.parent.name)
        if match is None:
            continue
        method = match["method"]
        text = log.read_text(encoding="utf-8")
        if '"train_runtime"' not in text:  # still training (or cut off): its seed would join the mean part-way
            print(f"study figures: {log.parent.name} has not finished training, left out", file=sys.stderr)
            continue
        for line in text.splitlines():
            record = json.loads(line)
            if "loss" in record and "train_runtime" not in record and record.get("step"):
                loss[method][record["step"]].append(float(record["loss"]))
        if '"a_k"' in text:
            steps, ratios = read_mixing_log(log)
            for key in ("k", "v"):
                for step, per_layer in zip(steps, ratios[key]):
                    share[method][key][step].append(float(np.mean(per_layer)))
    return loss, share


def figure(folder: Path) -> Path:
    loss, share = curves(folder)
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(figure(Path(sys.argv[1])))
