#!/usr/bin/env bash
# Commit study part 4's small files as they appear, polling every 60 s, beside `PART=4 ./scripts/study.sh`: each
# finished run's eval.json, log.jsonl and settings.yaml, the picks the study writes (tuning/<task>/lr,
# tuning/<task>/bitune_warm.yaml, <task>/lora_compute.yaml), the step-cost benches, and each folder's report
# regenerated over its finished runs (the tuning split's apart from the reported one's; part 5: the links to part
# 4's runs and the report's settings), and a reported task's
# training figure and dynamics table (scripts/study_figures.py: training.png, training.md). Weights are never added
# (.gitignore keeps final/ and checkpoints out). A session that ends loses at most the run in progress.
cd "$(dirname "$0")/.."
OUT=${OUT4:-results/qwen2.5-arc-easy-csqa}
LABEL=${LABEL:-study part 4}  # part 5: OUT4=results/qwen2.5-bitune-recipe LABEL="study part 5"
BITUNE=${BITUNE:-.venv/bin/bitune}
while true; do
  for f in "$OUT"/*/eval.json "$OUT"/*/*/eval.json "$OUT"/tuning/*/*/eval.json; do
    [ -f "$f" ] || continue
    d=$(dirname "$f")
    files=$(ls "$d"/eval.json "$d"/log.jsonl "$d"/settings.yaml 2>/dev/null)
    if [ -n "$(git status --porcelain -- $files)" ]; then
      folder=$(dirname "$d")
      task=$folder
      case "$folder" in
        "$OUT"/tuning/*)  # a tuning folder's own report
          OMP_NUM_THREADS=1 "$BITUNE" report "$folder" --output "$folder" > /dev/null 2>&1 ;;
        *)  # the study's report (report.yaml's runs: the reported split's folders), embedded in its README
          folder=$OUT
          OMP_NUM_THREADS=1 "$BITUNE" report "$OUT" --output "$OUT" --embed "$OUT/README.md" > /dev/null 2>&1
          [ "$task" = "$OUT" ] || OMP_NUM_THREADS=1 .venv/bin/python scripts/study_figures.py "$task" > /dev/null 2>&1 ;;
      esac
      extra=$(ls "$folder"/report.md "$folder"/report.csv "$folder"/report.png "$folder"/README.md "$folder"/lr \
        "$folder"/*.yaml "$task"/training.png "$task"/training.md "$OUT"/bench/*.json "$OUT"/*/lora_compute.yaml 2>/dev/null | git check-ignore -nv --stdin \
        | awk -F'\t' '$1 == "::" {print $2}')  # not the ignored ones (a sweep's per-task report)
      for i in 1 2 3 4 5; do
        git add -- $files $extra && git commit -q -m "$LABEL: ${d#results/} finished (eval.json, log, settings; report regenerated)" --only -- $files $extra && break
        sleep 5
      done
    fi
  done
  for f in "$OUT"/*/*; do  # part 5: the earlier study's runs linked in (the links, not what they point to)
    if [ -L "$f" ] && [ -n "$(git status --porcelain -- "$f")" ]; then
      git add -- "$f" && git commit -q -m "$LABEL: ${f#results/} linked" --only -- "$f"
    fi
  done
  for f in "$OUT"/bench/*.json "$OUT"/bench/*.load "$OUT"/*/lora_compute.yaml "$OUT"/tuning/*/lr "$OUT"/tuning/*/bitune_warm.yaml \
      "$OUT"/report.yaml; do
    [ -f "$f" ] || continue
    if [ -n "$(git status --porcelain -- "$f")" ]; then
      git add -- "$f" && git commit -q -m "$LABEL: ${f#results/} written" --only -- "$f"
    fi
  done
  sleep 60
done
