"""The report's figure (``report.png``): per task, each method's accuracy with its interval and the seeds as points.
matplotlib is imported here only, when a figure is drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ...stats import bootstrap_mean
from .records import TaskRuns, task_title


def plot_accuracy(tasks: dict[str, TaskRuns], metric: str, path: Path) -> Path | None:
    """Per task, each method's seed-averaged accuracy with its 95% interval and each seed as a point (PNG)."""
    try:
        import matplotlib
    except ImportError:
        print("bitune report: matplotlib is not installed (pip install 'bitune[plot]'); no figure written")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.6), squeeze=False)
    for ax, (task, tr) in zip(axes[0], tasks.items()):
        for x, (label, runs) in enumerate(tr.methods.items()):
            ci = bootstrap_mean(runs.averaged)
            ax.errorbar([x], [100 * ci.value], yerr=[[100 * (ci.value - ci.low)], [100 * (ci.high - ci.value)]],
                        fmt="o", color="black", capsize=5, markersize=7, zorder=3)
            seeds = 100 * runs.correct.mean(axis=1)  # (runs,)
            offsets = np.linspace(-0.12, 0.12, len(seeds)) if len(seeds) > 1 else np.zeros(1)
            ax.scatter(x + 0.25 + offsets, seeds, s=18, color="tab:blue", alpha=0.8, zorder=2,
                       label="seeds" if x == 0 else None)
        ax.set_xticks(range(len(tr.methods)), list(tr.methods), rotation=20, ha="right")
        ax.set_title(f"{task_title(task)} (n = {len(tr.doc_ids)})")
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(loc="best", fontsize=8)
    fig.suptitle(f"{metric}: mean over seeds, 95% CI over questions; dots: seeds", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path
