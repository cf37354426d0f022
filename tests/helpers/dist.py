"""Training jobs on a tiny in-process Llama, run the same way in one process (imported by the tests) or in
each process of ``torchrun`` (run as a module, with ``tests/`` on ``PYTHONPATH``:
``python -m torch.distributed.run ... -m helpers.dist``), and what the multi-process tests compare them by."""

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
from bitune.data.collate import Collator
from bitune.train.settings import TrainSettings
from bitune.train.trainer import build_trainer, run_training
from helpers.compare import trainable
from helpers.data import rank_lengths, samples
from helpers.models import perturb_adapters, tiny_bitune, tiny_model

TESTS = Path(__file__).resolve().parents[1]
"""The ``tests/`` folder: on ``PYTHONPATH`` in the launched processes, so that ``helpers`` imports there too."""


class Interrupt:
    """A step hook that simulates a crash right after optimizer step ``at``."""

    def __init__(self, at: int):
        self.at = at

    def __call__(self, step, model):
        if step == self.at:
            raise KeyboardInterrupt


def train_tiny(output_dir: str, variant: str = "bitune", method: str = "lora", batch_size: int = 2,
               grad_accum: int = 2, steps: int = 4, save_every: int | None = None, resume: bool = False,
               interrupt_at: int | None = None, lr: float = 1e-2, fsdp: bool = False,
               checkpointing: bool = False, clip: str = "all", max_grad_norm: float = 1.0):
    """Train a fresh tiny Llama (same initial weights every call) on 16 :func:`~helpers.data.samples` of
    :func:`~helpers.data.rank_lengths`; returns the trainer."""
    settings = TrainSettings.from_dict(dict(
        model="tiny", dataset="tiny", output_dir=output_dir, batch_size=batch_size, grad_accum=grad_accum,
        steps=steps, lr=lr, log_every=1, seed=0, save_every=save_every, save_total_limit=None,
        warmup_ratio=0.0, bitune={"variant": variant, "method": method}, fsdp=fsdp,
        recompute=checkpointing, clip=clip, max_grad_norm=max_grad_norm))
    transformers.set_seed(settings.seed)
    model = perturb_adapters(tiny_bitune(config=settings.bitune))  # LoRA B != 0: no all-zero grads
    trainer = build_trainer(model, settings, samples(16, lengths=rank_lengths), None, Collator(0), tensorboard=True)
    if interrupt_at is not None:
        trainer.add_step_hook(Interrupt(interrupt_at))
    run_training(trainer, settings, resume=resume)
    return trainer


def train_global_batch(run_dir: Path, **kwargs):
    """:func:`train_tiny` in 1 process with batch 4 x accumulation 2 for 4 steps (global batch 8): what 2
    processes x batch 2 x accumulation 2 must reach; returns the trainer."""
    return train_tiny(str(run_dir), batch_size=4, grad_accum=2, steps=4, **kwargs)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The trainable weights of the model a run saved to ``run_dir/final``."""
    return trainable(BituneModel.from_pretrained(run_dir / "final", base=tiny_model()))


def check(job: subprocess.CompletedProcess) -> None:
    """The launched job succeeded; otherwise the end of its output is the failure message."""
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]


def torchrun(nproc: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run this module (:func:`main`) in ``nproc`` gloo processes, one thread each."""
    path = [str(TESTS), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "helpers.dist", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("job", choices=["train", "variants"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default="")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save-every", type=int)
    parser.add_argument("--interrupt-at", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--method", default="lora")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--clip", default="all")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.job == "train":
        try:
            train_tiny(args.out, method=args.method, batch_size=args.batch_size, steps=args.steps,
                       save_every=args.save_every, resume=args.resume, interrupt_at=args.interrupt_at, fsdp=args.fsdp,
                       checkpointing=args.checkpointing, clip=args.clip, max_grad_norm=args.max_grad_norm)
        except KeyboardInterrupt:
            sys.exit(3)
        return
    trained = {}
    for spec in args.variants.split(","):
        variant, method = spec.split(":")
        trainer = train_tiny(f"{args.out}/{variant}-{method}", variant, method, batch_size=1, grad_accum=1, steps=2,
                             fsdp=args.fsdp)
        trained[spec] = trainer.state.global_step
    if int(os.environ["RANK"]) == 0:
        Path(args.out, "done.json").write_text(json.dumps(trained))


if __name__ == "__main__":
    main()
