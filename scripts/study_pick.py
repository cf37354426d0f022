"""Pick the best of several one-seed runs on the tuning split (study part 4: the learning rate, the start share).

    python scripts/study_pick.py results/qwen2.5-arc-easy-csqa/arc_easy/tuning lora_lr1e-4 lora_lr3e-4 ...

Prints the label of the run with the highest accuracy on the folder's one task (its tuning split: the folder's
runs must all have been evaluated on it); a tie keeps the label named first. Every candidate's accuracy with its 95%
bootstrap interval goes to stderr. Exit 2 when a candidate has no run or the runs are not on the tuning split.
"""

from __future__ import annotations

import sys

from bitune.cli import run_script
from bitune.data.datasets import DATASETS
from bitune.eval.report import check_splits, collect_runs, find_results, load_records
from bitune.stats import bootstrap_mean


def main(folder: str, labels: list[str]) -> int:
    records = load_records(find_results([folder]))
    tasks, _ = collect_runs(records)
    if len(tasks) != 1:
        print(f"study pick: {folder}: expected one task's runs, found {sorted(tasks)}", file=sys.stderr)
        return 2
    (task, runs), = tasks.items()
    split = check_splits(records)[task]
    if split != DATASETS[task].dev_split:
        print(f"study pick: {folder}: runs on {task}'s {split} split, not its tuning split "
              f"({DATASETS[task].dev_split})", file=sys.stderr)
        return 2
    missing = [label for label in labels if label not in runs.methods]
    if missing:
        print(f"study pick: {folder}: no run of {', '.join(missing)}", file=sys.stderr)
        return 2
    scores = {label: bootstrap_mean(runs.methods[label].averaged) for label in labels}
    best = max(labels, key=lambda label: (scores[label].value, -labels.index(label)))
    for label in labels:
        print(f"study pick: {task} ({split}, n = {len(runs.doc_ids)}): {label} {scores[label].text()}"
              f"{'  <- best' if label == best else ''}", file=sys.stderr)
    print(best)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(run_script("study pick", lambda: main(sys.argv[1], sys.argv[2:])))
