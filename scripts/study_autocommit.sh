#!/usr/bin/env bash
# Commit each finished part-3 run's small files (eval.json, log.jsonl, settings.yaml) as soon as its eval.json
# exists, polling every 60 s; run it beside `PART=3 ./scripts/study.sh` so a session that ends loses at most
# the run in progress. Weights are never added (.gitignore keeps final/ and checkpoints out).
cd "$(dirname "$0")/.."
while true; do
  for f in results/smollm2-csqa-piqa-siqa/*/*/eval.json; do
    [ -f "$f" ] || continue
    d=$(dirname "$f")
    if [ -n "$(git status --porcelain -- "$d")" ]; then
      files=$(ls "$d"/eval.json "$d"/log.jsonl "$d"/settings.yaml 2>/dev/null)
      for i in 1 2 3 4 5; do
        git add -- $files 2>/dev/null && git commit -q -m "study part 3: ${d#results/} finished (eval.json, log, settings)" --only -- $files && break
        sleep 5
      done
    fi
  done
  sleep 60
done
