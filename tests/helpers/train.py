"""A ``bitune train`` trainer on a fresh tiny Llama, and the training log it writes."""

from __future__ import annotations

import json
from pathlib import Path

import transformers

from bitune.data.collate import Collator
from bitune.train.run_folder import LOG_FILE
from bitune.train.settings import TrainSettings
from bitune.train.trainer import build_trainer
from helpers.data import samples
from helpers.models import tiny_bitune


def make_trainer(tmp_path: Path, data: list[dict] | None = None, callbacks=(), **overrides):
    """A BituneTrainer on a fresh tiny Llama; the same arguments always give the same initial weights."""
    opts = dict(model="tiny", dataset="tiny", output_dir=str(tmp_path / "run"), batch_size=2, grad_accum=2,
                steps=6, lr=1e-2, log_every=1, seed=0, bitune={"variant": "bitune"})
    opts.update(overrides)
    settings = TrainSettings.from_dict(opts)
    transformers.set_seed(settings.seed)
    model = tiny_bitune(config=settings.bitune, prompt_passes=settings.prompt_passes)
    trainer = build_trainer(model, settings, data if data is not None else samples(), None, Collator(0),
                            tensorboard=False)
    for cb in callbacks:
        trainer.add_step_hook(cb)
    return trainer, settings


def read_log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / LOG_FILE).read_text().splitlines()]
