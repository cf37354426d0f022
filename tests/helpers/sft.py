"""A tiny Bitune model trained by ``BituneSFTTrainer`` and by ``bitune train``'s loop on the same rows, the same
way in one process (imported by the tests) or in each process of ``accelerate launch`` (run as a module, with
``tests/`` on ``PYTHONPATH``: ``accelerate launch --num_processes 2 -m helpers.sft --out DIR``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from bitune import BituneModel
from helpers.models import perturb_adapters, tiny_bitune
from helpers.tokenizer import tiny_tokenizer

TESTS = Path(__file__).resolve().parents[1]
"""The ``tests/`` folder: on ``PYTHONPATH`` in the launched processes, so that ``helpers`` imports there too."""
DDP_CONFIG = TESTS.parent / "configs" / "accelerate" / "ddp.yaml"
WORDS = ["red", "blue", "green", "one", "two", "sky", "sea", "cat", "dog", "sun", "moon", "tree"]


def rows(n: int = 16) -> list[dict]:
    """Prompt-completion rows of mixed prompt and answer lengths (prompts verbatim, answers start with a space)."""
    out = []
    for i in range(n):
        words = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % 4))
        answer = " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(1 + (2 * i) % 5))
        out.append({"prompt": f"q{i}: {words}?", "completion": f" {answer}."})
    return out


def write_bitune_rows(path: Path, trl_rows: list[dict]) -> str:
    """The same rows in ``bitune train``'s file format for verbatim prompts (``prompt`` / ``answer``)."""
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["completion"]}) + "\n" for r in trl_rows))
    return str(path)


def fresh_model(variant: str = "bitune") -> BituneModel:
    """The same initial weights every call (LoRA B perturbed off zero, so every parameter gets a gradient)."""
    transformers.set_seed(0)
    return perturb_adapters(tiny_bitune(variant=variant))


def sft_config(output_dir: str, **overrides):
    """An ``SFTConfig`` for CPU: fp32, no gradient checkpointing, AdamW as ``bitune train`` runs it."""
    from trl import SFTConfig

    options = dict(output_dir=output_dir, bf16=False, use_cpu=True, activation_checkpointing=False, report_to="none",
                   per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2,
                   lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.1, seed=0,
                   optim="adamw_torch", logging_steps=1, save_strategy="no", max_length=128,
                   train_sampling_strategy="group_by_length", disable_tqdm=True, dataset_num_proc=None)
    options.update(overrides)
    return SFTConfig(**options)


def sft_trainer(output_dir: str, train_rows: list[dict] | None = None, model: BituneModel | None = None,
                tokenizer=None, callbacks=None, **overrides):
    """A ``BituneSFTTrainer`` over ``train_rows`` (default :func:`rows`) with :func:`sft_config`."""
    from datasets import Dataset

    from bitune.trl import BituneSFTTrainer

    return BituneSFTTrainer(model=model if model is not None else fresh_model(),
                            args=sft_config(output_dir, **overrides),
                            train_dataset=Dataset.from_list(train_rows if train_rows is not None else rows()),
                            processing_class=tokenizer if tokenizer is not None else tiny_tokenizer(),
                            callbacks=callbacks)


def accelerate_launch(nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run this module (:func:`main`) under ``accelerate launch`` with the project's DDP config (the README's line)
    in ``nproc`` processes: gloo on CPU, one thread each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(DDP_CONFIG), "--num_processes",
           str(nproc), "-m", "helpers.sft", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = sft_trainer(args.out, per_device_train_batch_size=args.batch_size)
    trainer.train()
    trainer.save_model(str(Path(args.out) / "final"))


if __name__ == "__main__":
    main()
