#!/usr/bin/env bash
# The evidence study: SmolLM2-135M, pretrained vs LoRA r8 vs Bitune (LoRA r8), 3 seeds, ARC-Challenge and
# CommonsenseQA, each evaluated on its full evaluation split (ARC-C test: 1172 questions, CSQA validation: 1221),
# then the shared_weights ablation (one weight set for both prompt passes) on ARC-C, then the paired report and
# figure, embedded in results/smollm2-arc-csqa/README.md.
#
# Resumable: a run whose eval.json exists is skipped, so running this again after an interruption (also in a
# fresh clone holding only the committed small files) continues where it stopped.
#   THREADS=2 ./scripts/study.sh                 # 2-core CPU (what results/smollm2-arc-csqa was made with)
#   OUT=results/smollm2-paper CONFIG_DIR=configs/tasks ./scripts/study.sh
#                                          # the paper's protocol as written (batch 1 x 10, CSQA one epoch; GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/smollm2-arc-csqa}
CONFIG_DIR=${CONFIG_DIR:-configs/study}
SEEDS=${SEEDS:-42 43 44}
export OMP_NUM_THREADS=${THREADS:-2}
BITUNE=${BITUNE:-.venv/bin/bitune}

for seed in $SEEDS; do  # seed by seed, so an interrupted study holds complete LoRA/Bitune pairs
  for task in arc_challenge csqa; do
    "$BITUNE" sweep --config "$CONFIG_DIR/$task.yaml" --methods pretrained,lora,bitune --seeds "$seed" \
      --tasks "$task" --output-dir "$OUT/$task"
  done
done
for seed in $SEEDS; do  # the ablation: one weight set for both prompt passes
  "$BITUNE" sweep --config "$CONFIG_DIR/arc_challenge.yaml" --methods shared_weights \
    --seeds "$seed" --tasks arc_challenge --output-dir "$OUT/arc_challenge"
done
if [ -f "$OUT/README.md" ]; then
  "$BITUNE" report "$OUT" --output "$OUT" --embed "$OUT/README.md"
else
  "$BITUNE" report "$OUT" --output "$OUT"
fi
