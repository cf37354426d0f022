#!/usr/bin/env bash
# Commit each finished part-3 run's small files (eval.json, log.jsonl, settings.yaml) as soon as its eval.json
# exists, polling every 60 s, together with the study's report regenerated over every finished run (report.md,
# report.csv, report.png and the study README's embed, which tests/test_results.py checks; the main README shows
# part 4's summary); run it beside `PART=3 ./scripts/study.sh` so a session that ends loses at most the run in
# progress. Weights are never added (.gitignore keeps final/ and checkpoints out). It commits the study README
# whole: edit it elsewhere and copy it in at once while this runs.
cd "$(dirname "$0")/.."
OUT=${OUT3:-results/smollm2-csqa-piqa-siqa}
BITUNE=${BITUNE:-.venv/bin/bitune}
while true; do
  for f in "$OUT"/*/*/eval.json; do
    [ -f "$f" ] || continue
    d=$(dirname "$f")
    files=$(ls "$d"/eval.json "$d"/log.jsonl "$d"/settings.yaml 2>/dev/null)
    if [ -n "$(git status --porcelain -- $files)" ]; then
      OMP_NUM_THREADS=1 "$BITUNE" report "$OUT" --output "$OUT" --embed "$OUT/README.md" > /dev/null
      report="$OUT/report.md $OUT/report.csv $OUT/report.png $OUT/README.md"
      for i in 1 2 3 4 5; do
        git add -- $files $report && git commit -q -m "study part 3: ${d#results/} finished (eval.json, log, settings; report regenerated)" --only -- $files $report && break
        sleep 5
      done
    fi
  done
  sleep 60
done
