#!/usr/bin/env bash
# What a short run on a user's own data does (study part 4, issue 40 item 6): 30 chat rows of general questions
# (results/own-data-check/chats.jsonl), the documented chat config (configs/instruct/chat_demo.yaml: SmolLM2-135M,
# LoRA r8, lr 3e-4, 30 steps x 4 rows), seed 42, for LoRA, Bitune from the paper's start (bidirectional share 0.5)
# and Bitune from share 0.1 (bitune.init_share=0.1). Each model, and the base model with the same chat template,
# answers "What is the capital of Italy?" greedily and is scored on the first 200 questions of ARC-Easy's tuning
# (validation) split, paired. Resumable: a model whose eval.json exists is skipped.
#   THREADS=1 ./scripts/own_data_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/own-data-check}
BITUNE=${BITUNE:-.venv/bin/bitune}
export OMP_NUM_THREADS=${THREADS:-1}
QUESTION="What is the capital of Italy?"
evaluate() {  # run folder, label, then the model options
  local dir=$1 label=$2; shift 2
  [ -f "$dir/eval.json" ] && return 0
  mkdir -p "$dir"
  "$BITUNE" generate "$@" --template chat --prompt "$QUESTION" --max-new-tokens 16 > "$dir/answer.txt"
  "$BITUNE" eval "$@" --template chat --tasks arc_easy --split tuning --limit 200 --label "$label" \
    --output "$dir/eval.json"
}
evaluate "$OUT/pretrained" pretrained --model smollm2-135m
for m in lora bitune bitune_share0.1; do
  case $m in
    lora) sets=(--set bitune.variant=lora) ;;
    bitune) sets=() ;;
    bitune_share0.1) sets=(--set bitune.init_share=0.1) ;;
  esac
  if [ ! -f "$OUT/$m/final/bitune_config.json" ]; then
    "$BITUNE" train --config configs/instruct/chat_demo.yaml --set "dataset=$OUT/chats.jsonl" --set seed=42 \
      --set "output_dir=$OUT/$m" "${sets[@]}" --overwrite
  fi
  evaluate "$OUT/$m" "$m" --checkpoint "$OUT/$m/final"
done
"$BITUNE" report "$OUT" --output "$OUT/report"
