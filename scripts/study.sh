#!/usr/bin/env bash
# The evidence study: SmolLM2-135M, pretrained vs LoRA r8 vs Bitune (LoRA r8), 3 seeds, ARC-Challenge and
# CommonsenseQA, each evaluated on its full evaluation split (ARC-C test: 1172 questions, CSQA validation: 1221),
# then the shared_weights ablation (one weight set for both prompt passes) on ARC-C, then (part 2) LoRA r16 and
# LoRA r8 with Bitune's compute on both tasks, then the paired report and figure, embedded in
# results/smollm2-arc-csqa/README.md; then the base-model study on Gemma 3 270M (results/gemma3-csqa; skip it
# with BASE_MODEL=0).
#
# Resumable: a run whose eval.json exists is skipped, so running this again after an interruption (also in a
# fresh clone holding only the committed small files) continues where it stopped.
#   THREADS=2 ./scripts/study.sh                 # 2-core CPU (what results/smollm2-arc-csqa was made with)
#   OUT=results/smollm2-paper CONFIG_DIR=configs/tasks ./scripts/study.sh
#                                          # the paper's protocol as written (batch 1 x 10, CSQA one epoch; GPU)
#   PART=3 THREADS=2 ./scripts/study.sh         # part 3 only (results/smollm2-csqa-piqa-siqa), see part3() below
#   PART=4 THREADS=2 ./scripts/study.sh         # part 4 only (results/qwen2.5-arc-easy-csqa), see part4() below
#   PART=4 TASKS4=arc_easy SEEDS="43 44" GRID4=lora ./scripts/study.sh  # only these grid runs (to fit a session)
#   PART=5 THREADS=1 ./scripts/study.sh         # part 5 only (results/qwen2.5-bitune-recipe), see part5() below
#
# Part 3 (results/smollm2-csqa-piqa-siqa): CSQA and (if LoRA learns it; PIQA and SIQA did not) ARC-Easy, each
# with pretrained, LoRA r8, LoRA r16, LoRA r8
# given Bitune's compute and Bitune r8 x seeds 42/43/44, all trained by the code of ONE commit (the file COMMIT in
# that folder) so that the methods draw the same batches: the runs import bitune from a git worktree at that
# commit (PIN_TREE, made once; this checkout's newer code is not used for them), read their configs from it, and
# write their small files here, where they are committed. On CSQA also lora_repeat: LoRA r8 with Bitune's compute
# on only the examples Bitune saw (data_steps: 200). Each run's log.jsonl records the commit and every step's
# batch digest; the report checks neither, tests/test_results.py does.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/smollm2-arc-csqa}
CONFIG_DIR=${CONFIG_DIR:-configs/study}
SEEDS=${SEEDS:-42 43 44}
export OMP_NUM_THREADS=${THREADS:-2}
BITUNE=${BITUNE:-.venv/bin/bitune}


part3() {
  local out=${OUT3:-results/smollm2-csqa-piqa-siqa}
  pin_tree "$out"  # bitune imported from the pinned tree, ahead of this checkout's
  # Configs are read from this checkout (each run's settings.yaml records them whole; the step counts of
  # configs/study/part3 were measured at the pin); the code is the pinned commit's.
  local conf="configs/study" ec="configs/study/part3"
  sweep() {  # task, methods, seed
    "$BITUNE" sweep --config "$conf/$1.yaml" --methods "$2" --seeds "$3" --tasks "$1" --output-dir "$out/$1"
  }
  # First, does LoRA (seed 42) lift each candidate task above its trivial baselines (scripts/study_check.py)?
  # PIQA did not (LoRA 52.7% [50.5, 55.0] vs always-1 50.5% and the pretrained model 53.0%), nor did SIQA (LoRA
  # 33.0% [30.9, 35.1] vs always-2 33.6%): both are dropped; ARC-Easy, checked in their place, passed (LoRA 44.7%
  # [42.6, 46.7] vs always-2 26.6%).
  for task in piqa siqa arc_easy; do sweep "$task" pretrained,lora 42; done
  # Task by task (CSQA first, with the equal-compute test), seed by seed within it: an interrupted study holds
  # whole tasks with all four methods and paired seeds, rather than every task half done. A task joins only if
  # its check passed (CSQA's LoRA learnt it in parts 1-2; its check runs on its own seed-42 run once made).
  for task in csqa arc_easy; do
    if [ "$task" != csqa ] && ! PYTHONPATH= .venv/bin/python scripts/study_check.py "$out/$task"; then
      echo "study part 3: $task failed the check; no further runs on it" >&2
      continue
    fi
    for seed in $SEEDS; do
      sweep "$task" "pretrained,lora,lora16,$ec/$task/lora_compute.yaml,bitune" "$seed"
    done
    if [ "$task" = csqa ]; then  # more steps or more data? LoRA with Bitune's compute on Bitune's 2000 examples
      for seed in $SEEDS; do sweep csqa "$ec/csqa/lora_repeat.yaml" "$seed"; done
    fi
  done
  unset PYTHONPATH
  report "$out"
}

# Part 4 (results/qwen2.5-arc-easy-csqa; issue "Evidence, part 4"): the paper's protocol on Qwen2.5-Coder-0.5B.
# Per task (ARC-Easy complete first, then CSQA): (1) the step costs on the task's real lengths (bitune bench data,
# 3 rounds) set lora_compute's steps; (2) on the tuning split (never the reported one), the pretrained model and
# LoRA at lr 1e-4, 3e-4, 1e-3, 3e-3 (seed 42): the best lr is used by every method, and LoRA at it must pass the
# check (above the best trivial baseline and the pretrained model); (3) Bitune at start shares 0.1 and 0.01 on the
# tuning split (seed 42): the better one is bitune_warm; (4) on the reported split, pretrained, lora, bitune,
# lora_compute and bitune_warm x seeds 42, 43, 44, seed by seed. Every pick is written to a file in the task's
# folder (tuning/<task>/lr and bitune_warm.yaml, <task>/lora_compute.yaml) that the next steps read, so a resumed
# study picks the same. Report the reported-split runs with `bitune report OUT/arc_easy OUT/csqa`.
part4() {
  local out=${OUT4:-results/qwen2.5-arc-easy-csqa}
  pin_tree "$out"
  local conf="configs/study/part4" py=".venv/bin/python"
  local tasks=${TASKS4:-arc_easy csqa}
  for task in $tasks; do
    local dir="$out/$task" tdir="$out/tuning/$task" steps  # reported-split runs; tuning-split runs and picks
    mkdir -p "$dir" "$tdir"
    steps=$(PYTHONPATH= "$py" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['steps'])" "$conf/$task.yaml")
    if [ ! -f "$out/bench/data_$task.json" ]; then  # the step-cost factor wants a quiet machine: wait for one
      mkdir -p "$out/bench"
      for _ in $(seq 30); do
        awk '{exit !($1 < 0.5)}' /proc/loadavg && break
        echo "study part 4: waiting for a quiet machine to measure the step costs (load $(cut -d' ' -f1 /proc/loadavg))" >&2
        sleep 60
      done
      cut -d' ' -f1-3 /proc/loadavg > "$out/bench/data_$task.load"
      "$BITUNE" bench data --config "$conf/$task.yaml" --steps 5 --rounds 3 --output "$out/bench/data_$task.json"
      cut -d' ' -f1-3 /proc/loadavg >> "$out/bench/data_$task.load"
    fi
    if [ ! -f "$dir/lora_compute.yaml" ]; then
      "$py" - "$out/bench/data_$task.json" "$steps" "$dir/lora_compute.yaml" <<'PY'
import json, sys
ratio, steps = json.load(open(sys.argv[1]))["time_ratio"], int(sys.argv[2])
open(sys.argv[3], "w").write(
    f"# LoRA r8 given Bitune's training compute: a Bitune step costs {ratio:.2f}x a LoRA step on this task's real\n"
    f"# lengths (bench/{sys.argv[1].rsplit('/', 1)[1]}, median of 3 rounds), so LoRA trains round({steps} x {ratio:.2f})"
    f" steps on the\n# same sequence of batches continued (written by scripts/study.sh PART=4).\n"
    f"bitune:\n  variant: lora\n  method: lora\n  rank: 8\nsteps: {round(steps * ratio)}\n")
PY
    fi
    local lrs="$conf/lr/lora_lr1e-4.yaml,$conf/lr/lora_lr3e-4.yaml,$conf/lr/lora_lr1e-3.yaml,$conf/lr/lora_lr3e-3.yaml"
    sweep_each --config "$conf/$task.yaml" --seeds 42 --tasks "$task" --split tuning --output-dir "$tdir" \
      -- pretrained ${lrs//,/ }
    "$BITUNE" sweep --config "$conf/$task.yaml" --methods "pretrained,$lrs" --seeds 42 --tasks "$task" \
      --split tuning --output-dir "$tdir"  # all done by now: the report over every run
    if [ ! -f "$tdir/lr" ]; then
      local best
      best=$(PYTHONPATH= "$py" scripts/study_pick.py "$tdir" lora_lr1e-4 lora_lr3e-4 lora_lr1e-3 lora_lr3e-3)
      if ! PYTHONPATH= "$py" scripts/study_check.py "$tdir" "$best"; then
        echo "study part 4: $task failed the check at its best learning rate; no further runs on it" >&2
        continue
      fi
      echo "${best#lora_lr}" > "$tdir/lr"
    fi
    local lr
    lr=$(cat "$tdir/lr")
    sweep_each --config "$conf/$task.yaml" --set "lr=$lr" --seeds 42 --tasks "$task" --split tuning \
      --output-dir "$tdir" -- "$conf/bitune_share0.1.yaml" "$conf/bitune_share0.01.yaml"
    # The pinned commit's sweep reports the runs of its own call (here one method each), which replaced the tuning
    # folder's report of every run; this checkout's sweep reports the folder. Write the folder's report again.
    PYTHONPATH= "$BITUNE" report "$tdir" --output "$tdir" > /dev/null
    if [ ! -f "$tdir/bitune_warm.yaml" ]; then
      local warm
      warm=$(PYTHONPATH= "$py" scripts/study_pick.py "$tdir" bitune_share0.1 bitune_share0.01)
      { echo "# bitune_warm: Bitune r8 from the start share picked on the tuning split ($warm; scripts/study.sh)."
        grep -v '^#' "$conf/$warm.yaml"; } > "$tdir/bitune_warm.yaml"
    fi
    local -a grid=()
    local m
    for m in ${GRID4:-pretrained lora bitune lora_compute bitune_warm}; do  # GRID4: a subset, to pack a session
      case "$m" in
        pretrained|lora|bitune) grid+=("$m") ;;
        lora_compute) grid+=("$dir/lora_compute.yaml") ;;
        bitune_warm) grid+=("$tdir/bitune_warm.yaml") ;;
        *) echo "study: GRID4 names an unknown method '$m' (pretrained lora bitune lora_compute bitune_warm)" >&2
           exit 2 ;;
      esac
    done
    for seed in $SEEDS; do
      sweep_each --config "$conf/$task.yaml" --set "lr=$lr" --seeds "$seed" --tasks "$task" --output-dir "$dir" \
        -- "${grid[@]}"
    done
    local methods="${grid[*]}"
    "$BITUNE" sweep --config "$conf/$task.yaml" --set "lr=$lr" --seeds ${SEEDS// /,} --tasks "$task" \
      --methods "${methods// /,}" --output-dir "$dir"  # every run done by now: the report over them
  done
  unset PYTHONPATH
}

# One `bitune sweep` per method (the arguments before `--` are every sweep's, the methods follow it), LANES of
# them at a time (default 1). On a 2-core machine one run at 2 threads gets more done than two 1-thread lanes: a
# part-4 Bitune run trained its 225 steps in 49 min alone at 2 threads against 137 min in a lane beside another
# (1.4x the throughput; LANES=2 also needs twice the memory: two Bitune runs fill 24 GB at their peaks). The runs
# are the same whatever LANES is: each draws its batches from its own seed; only
# the wall-clock times in the logs differ. Each process writes the folder's report over its own runs, so the
# caller runs one sweep over all of them afterwards (every run skipped) for the report over the folder.
sweep_each() {
  local -a common=() pids=()
  while [ "$1" != -- ]; do common+=("$1"); shift; done
  shift
  local method failed=0
  for method in "$@"; do
    lane "${common[@]}" --methods "$method" &
    pids+=("$!")
    if [ "${#pids[@]}" -ge "${LANES:-1}" ]; then
      wait "${pids[0]}" || failed=1
      pids=("${pids[@]:1}")
    fi
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  return "$failed"
}

# One sweep, started again up to twice if it fails (a lane killed, e.g. by the kernel when memory runs short, resumes
# from its run's last checkpoint; a real error fails the same way three times and fails the lane).
lane() {
  local try
  for try in 1 2 3; do
    "$BITUNE" sweep "$@" && return 0
    echo "study: sweep $* failed (try $try of 3)" >&2
    sleep 10
  done
  return 1
}

# The study's code: a git worktree at the commit in $1/COMMIT, imported ahead of this checkout's (so every method
# of a study draws the same batches from the same code, whatever this checkout holds now).
pin_tree() {
  local pin tree got
  pin=$(cat "$1/COMMIT")
  tree=${PIN_TREE:-.study/$pin}
  if [ ! -d "$tree" ]; then
    git worktree add --detach "$tree" "$pin"
  fi
  export PYTHONPATH="$PWD/$tree/src"
  got=$(.venv/bin/python -c 'from bitune.provenance import source_commit; print(source_commit())')
  if [ "$got" != "$pin" ]; then
    echo "study: bitune imports from commit $got, not the pinned $pin" >&2
    exit 1
  fi
}

report() {
  if [ -f "$1/README.md" ]; then
    "$BITUNE" report "$1" --output "$1" --embed "$1/README.md"
  else
    "$BITUNE" report "$1" --output "$1"
  fi
}

# Part 5 (results/qwen2.5-bitune-recipe; issue "Evidence, part 5"): Bitune with a recipe tuned for Bitune, at part
# 4's pinned commit (its COMMIT is part 4's), model, tasks, batches and tuning splits. Per task (CSQA first: its
# runs are the shorter): (1) on the tuning split, Bitune r8 with clip: adapters at lr 3e-4, 1e-3, 3e-3 (seed 42);
# the pick is part 4's rule for LoRA (scripts/study_pick.py: highest tuning-split accuracy, a tie keeps the one
# named first), written to tuning/<task>/lr before any reported run; (2) on the reported split, bitune_recipe
# (configs/study/part5/bitune_recipe.yaml at the picked lr) x seeds 42, 43, 44. It is compared with part 4's lora,
# bitune and lora_compute runs of the same seeds, which drew the same batches from the same commit.
part5() {
  local out=${OUT5:-results/qwen2.5-bitune-recipe}
  pin_tree "$out"
  local conf="configs/study/part4" c5="configs/study/part5" py=".venv/bin/python"
  local tasks=${TASKS5:-csqa arc_easy}
  for task in $tasks; do mkdir -p "$out/$task"; done  # every task's folder first: the report's runs name them
  for task in $tasks; do
    local dir="$out/$task" tdir="$out/tuning/$task" lr
    mkdir -p "$dir" "$tdir"
    local -a lrs=("$c5/lr/bitune_clip_lr3e-4.yaml" "$c5/lr/bitune_clip_lr1e-3.yaml" "$c5/lr/bitune_clip_lr3e-3.yaml")
    sweep_each --config "$conf/$task.yaml" --seeds 42 --tasks "$task" --split tuning --output-dir "$tdir" \
      -- "${lrs[@]}"
    PYTHONPATH= "$BITUNE" report "$tdir" --output "$tdir" > /dev/null
    if [ ! -f "$tdir/lr" ]; then
      local best
      best=$(PYTHONPATH= "$py" scripts/study_pick.py "$tdir" bitune_clip_lr3e-4 bitune_clip_lr1e-3 bitune_clip_lr3e-3)
      echo "${best#bitune_clip_lr}" > "$tdir/lr"
    fi
    lr=$(cat "$tdir/lr")
    [ "${TUNING5_ONLY:-0}" = 1 ] && continue
    for seed in $SEEDS; do
      sweep_each --config "$conf/$task.yaml" --set "lr=$lr" --seeds "$seed" --tasks "$task" --output-dir "$dir" \
        -- "$c5/bitune_recipe.yaml"
    done
    # Part 4's runs it is compared with, linked (relative links: they keep their commit and batch digests, and the
    # report reads them through the links; bitune report follows linked folders)
    local part4=${OUT4:-results/qwen2.5-arc-easy-csqa}
    [ -d "$part4/$task/pretrained" ] && ln -sfn "../../$(basename "$part4")/$task/pretrained" "$dir/pretrained"
    for seed in $SEEDS; do
      for m in lora bitune lora_compute; do
        [ -d "$part4/$task/$m-$seed" ] && ln -sfn "../../$(basename "$part4")/$task/$m-$seed" "$dir/$m-$seed"
      done
    done
    # The report's settings, once a task's compared runs all exist (before, a report of a tuning folder would find
    # methods it names in no run of the study)
    [ -f "$out/report.yaml" ] || cat > "$out/report.yaml" <<'YAML'
# How 'bitune report' orders study part 5's methods and which pairs it compares (bitune.eval.report.settings).
# Part 4's pretrained, lora, bitune and lora_compute runs are linked into arc_easy/ and csqa/ by scripts/study.sh.
methods: [pretrained, lora, lora_compute, bitune, bitune_recipe]  # rows in this order
fair_baselines: [lora_compute]  # the paper's arm is paired with LoRA at its compute, as in part 4
pairs: [[bitune_recipe, lora], [bitune_recipe, lora_compute], [bitune_recipe, bitune]]  # the new arm against each
runs: [arc_easy, csqa]  # the reported split's runs only (tuning/ holds another split's)
YAML
  done
  unset PYTHONPATH
  [ "${TUNING5_ONLY:-0}" = 1 ] || report "$out"
}

if [ "${PART:-all}" = 3 ]; then
  part3
  exit 0
fi
if [ "${PART:-all}" = 4 ]; then
  part4
  exit 0
fi
if [ "${PART:-all}" = 5 ]; then
  part5
  exit 0
fi

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
# Part 2, the baselines a skeptic asks for: lora16 (LoRA r16, as many trainable parameters as Bitune r8) and
# lora_compute (LoRA r8 given Bitune's training compute: 1.84x the steps, see configs/study/equal_compute/).
for seed in $SEEDS; do
  for task in arc_challenge csqa; do
    "$BITUNE" sweep --config "$CONFIG_DIR/$task.yaml" \
      --methods "lora16,configs/study/equal_compute/$task/lora_compute.yaml" --seeds "$seed" \
      --tasks "$task" --output-dir "$OUT/$task"
  done
done
report "$OUT"
# A base model: Gemma 3 270M (pretrained, not instruction-tuned) on CSQA, pretrained / LoRA r8 / Bitune r8.
if [ "${BASE_MODEL:-1}" = 1 ]; then
  GEMMA_OUT=${GEMMA_OUT:-results/gemma3-csqa}
  for seed in $SEEDS; do
    "$BITUNE" sweep --config configs/study/gemma3/csqa.yaml --methods pretrained,lora,bitune --seeds "$seed" \
      --tasks csqa --output-dir "$GEMMA_OUT/csqa"
  done
  report "$GEMMA_OUT"
fi
part3
