"""Training speed of ``BituneSFTTrainer`` against ``bitune train``'s loop, side by side on the same data.

Both train Bitune (LoRA r8) on SmolLM2-135M in fp32 over the same ARC-Easy rows, with the same batch size,
seed and length-grouped order, so they draw the same batches; they run alternately (``--rounds`` times each, the
order reversed every other round, as ``bitune bench`` interleaves) and every optimizer step is timed by a
callback. Prints the median seconds per step of each and their ratio.

    PYTHONPATH=src OMP_NUM_THREADS=2 python examples/trl_speed.py --steps 6 --batch-size 8 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import SFTConfig

from bitune import BituneConfig, BituneModel
from bitune.bench.helpers import interleaved
from bitune.data import load_examples, tokenize_dataset
from bitune.data.collate import Collator, pad_id
from bitune.hub import load_model
from bitune.train.settings import TrainSettings
from bitune.train.trainer import build_trainer, run_training
from bitune.trl import BituneSFTTrainer


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step (``on_step_end``, which both trainers call)."""

    def __init__(self):
        self.stamps = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])][1:]  # the first step warms up


def bitune_train(examples, steps: int, batch: int, out: str) -> list[float]:
    base, tokenizer = load_model("smollm2-135m")
    settings = TrainSettings.from_dict(dict(model="smollm2-135m", dataset="arc_easy", output_dir=out, steps=steps,
                                            batch_size=batch, grad_accum=1, lr=3e-4, warmup_ratio=0.0, seed=0,
                                            group_by_length=True, log_every=steps, save_every=None))
    samples = tokenize_dataset(tokenizer, examples, 512)[0]
    trainer = build_trainer(BituneModel.wrap(base, BituneConfig()), settings, samples, None,
                            Collator(pad_id(tokenizer)), tensorboard=False)
    timer = StepTimer()
    trainer.add_callback(timer)
    run_training(trainer, settings)
    return timer.step_times()


def trl_train(examples, steps: int, batch: int, out: str) -> list[float]:
    base, tokenizer = load_model("smollm2-135m")
    rows = Dataset.from_list([{"prompt": e.prompt, "completion": e.answer} for e in examples])
    args = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=3e-4,
                     seed=0, train_sampling_strategy="group_by_length", activation_checkpointing=False, bf16=False,
                     use_cpu=True, save_strategy="no", report_to="none", logging_steps=steps, max_length=512,
                     disable_tqdm=True)
    timer = StepTimer()
    trainer = BituneSFTTrainer(model=BituneModel.wrap(base, BituneConfig()), args=args, train_dataset=rows,
                               processing_class=tokenizer, callbacks=[timer])
    timer.stamps = [time.perf_counter()]
    trainer.train()
    return timer.step_times()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--examples", type=int, default=400, help="ARC-Easy train rows to draw batches from")
    args = parser.parse_args()
    examples = load_examples("arc_easy", "train", limit=args.examples)
    trainers = {"bitune train": bitune_train, "BituneSFTTrainer": trl_train}
    times = {name: [] for name in trainers}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            for i, name in enumerate(interleaved(trainers, r)):
                times[name] += trainers[name](examples, args.steps, args.batch_size, f"{tmp}/{i}")
        print(f"round {r + 1}: " + ", ".join(f"{k} {statistics.median(v):.2f} s/step" for k, v in times.items()))
    a, b = (statistics.median(times[k]) for k in ("bitune train", "BituneSFTTrainer"))
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch_size}, {len(times['bitune train'])} timed "
          f"steps each: bitune train {1 / a:.3f} steps/s, BituneSFTTrainer {1 / b:.3f} steps/s "
          f"(BituneSFTTrainer / bitune train step time: {b / a:.3f})")


if __name__ == "__main__":
    main()
