"""Does LoRA learn this task? The check before a task's study runs are spent (study part 3).

    python scripts/study_check.py results/smollm2-csqa-piqa-siqa/arc_easy    # exit 0: passed, 1: failed, 2: not run
    python scripts/study_check.py results/qwen2.5-arc-easy-csqa/arc_easy/tuning lora_lr1e-3   # another method label

Passes when LoRA r8's seed-42 run scores above the task's best trivial baseline (always answering the majority
answer position) with the whole 95% bootstrap interval over questions, and above the pretrained model. PIQA and
SIQA failed it at 200 steps x 10 on SmolLM2-135M (LoRA 52.7% [50.5, 55.0] vs always-1 50.5%; LoRA 33.0%
[30.9, 35.1] vs always-2 33.6%).
"""

from __future__ import annotations

import sys

from bitune.eval.report import collect_runs, find_results, load_records, trivial_baselines
from bitune.stats import bootstrap_mean


def main(folder: str, method: str = "lora") -> int:
    tasks, _ = collect_runs(load_records(find_results([folder])))
    if len(tasks) != 1:
        print(f"study check: {folder}: expected one task's runs, found {sorted(tasks)}", file=sys.stderr)
        return 2
    (task, runs), = tasks.items()
    if method not in runs.methods or "pretrained" not in runs.methods:
        print(f"study check: {task}: needs the pretrained and {method} runs", file=sys.stderr)
        return 2
    lora = bootstrap_mean(runs.methods[method].of_seeds([42])[0])
    pretrained = bootstrap_mean(runs.methods["pretrained"].averaged)
    k, best = trivial_baselines(runs).best
    passed = lora.low > best and lora.value > pretrained.value
    print(f"study check: {task}: {method} {lora.text()} vs always {k} {100 * best:.1f} and pretrained "
          f"{pretrained.text()} (n = {len(runs.doc_ids)}): {'passed' if passed else 'FAILED'}")
    return 0 if passed else 1


if __name__ == "__main__":
    from bitune.cli import run_script

    sys.exit(run_script("study check", lambda: main(*sys.argv[1:3])))
