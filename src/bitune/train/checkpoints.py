"""Training checkpoints: written whole or not at all, read back strictly, checked before a resume.

A ``checkpoint-N`` folder holds the model (:func:`bitune.checkpoint.save`: adapters, mixer, config; safetensors +
JSON; and the model card ``README.md``), ``optimizer.pt`` and ``scheduler.pt`` (state dicts: tensors and numbers
only, read with ``weights_only=True``), one RNG-state file per process (``rng_state.pth``, or
``rng_state_<rank>.pth``) and ``trainer_state.json`` (step, epoch, loss sum). Every process writes its RNG state
into a staging folder, the main process writes the rest, and the folder is renamed into place: ``checkpoint-N`` is
complete or absent.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..checkpoint import read_config, save
from ..errors import BituneError
from ..files import replace_dir, write_text_atomic
from ..model import BituneModel
from ..modelcard import Training
from . import sharding
from .run_folder import CHECKPOINT_PREFIX, STATE_FILE, checkpoints, rng_file, rotate

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_KEYS = ("global_step", "epoch", "loss_sum")
"""What ``trainer_state.json`` holds (:class:`bitune.train.trainer.TrainState`)."""


def rng_state() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU and CUDA) as tensors, tuples and numbers only."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
                                                    int(has_gauss), float(gauss)), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: Path, step: int, model: BituneModel, optimizer, scheduler, state: dict[str, Any],
                    accelerator, keep: int | None, sharded: bool = False, training: Training | None = None) -> None:
    """Write ``root/checkpoint-<step>`` atomically and keep the newest ``keep`` checkpoints.

    Every process calls it (each writes its RNG state); the main process writes the rest, renames and rotates.
    With ``sharded`` (FSDP) weights and optimizer state are gathered first: the files are the same as unsharded.
    ``training``: the run, for the model card (``README.md``, written in the staging folder like every file).
    """
    main = accelerator.is_main_process
    tensors = sharding.gathered(model.weight_tensors(), keep=main) if sharded else None
    optimizer_state = sharding.optimizer_state(optimizer, keep=main) if sharded else optimizer.state_dict()
    name = f"{CHECKPOINT_PREFIX}{step}"
    staging = root / f".staging-{name}"
    try:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
            save(model, staging, tensors, training, destination=root / name)  # replaces the staging folder: first
            torch.save(optimizer_state, staging / OPTIMIZER_FILE)
            torch.save(scheduler.state_dict(), staging / SCHEDULER_FILE)
        accelerator.wait_for_everyone()  # the staging folder exists for every process
        torch.save(rng_state(), staging / rng_file(accelerator.process_index, accelerator.num_processes))
        accelerator.wait_for_everyone()  # every process's file is in
        if main:
            write_text_atomic(staging / STATE_FILE, json.dumps(state, indent=1))
            replace_dir(staging, root / name)
    finally:
        if main:
            shutil.rmtree(staging, ignore_errors=True)
    if main:
        rotate(root, keep)
    accelerator.wait_for_everyone()  # checkpoint-N exists for every process once this returns


def load_checkpoint(path: Path, model: BituneModel, optimizer, scheduler, weights: bool = True) -> dict[str, Any]:
    """Load weights (strictly; the config must match), optimizer and scheduler; return the JSON state.

    Args:
        weights: also load the weights (False: the caller loaded them before sharding the model). Optimizer
            state of sharded parameters is cut to this process's shards.
    """
    saved = read_config(path)
    if saved != model.config:
        raise BituneError(f"{path} was trained with {saved}, this run uses {model.config}; use a new output_dir "
                          "for a different model")
    if weights:
        model.load_weights(path)
    state = json.loads((path / STATE_FILE).read_text())
    optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(sharding.shard_optimizer_state(optimizer, optimizer_state))  # as is when unsharded
    scheduler.load_state_dict(torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True))
    return {k: state[k] for k in STATE_KEYS}


def load_rng_state(path: Path, rank: int, world_size: int) -> None:
    """Restore this process's RNG states from a checkpoint."""
    set_rng_state(torch.load(path / rng_file(rank, world_size), map_location="cpu", weights_only=True))


def verify_checkpoint(path: Path, model: BituneModel | None = None) -> None:
    """Read every file of a checkpoint before training resumes, so corruption fails early with its name.

    Args:
        path: the ``checkpoint-N`` folder.
        model: when given, its weights are loaded from the checkpoint (strictly) as part of the check.

    Raises:
        BituneError: naming the missing or corrupt file.
    """
    try:
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BituneError(f"corrupt checkpoint file {path / STATE_FILE}: {e}") from e
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, dict) else list(STATE_KEYS)
    if missing:
        raise BituneError(f"{path} was written by an older bitune (transformers' Trainer layout: {STATE_FILE} "
                          f"lacks {', '.join(missing)}); this version cannot resume it exactly. Start afresh "
                          "(--overwrite) or finish the run with the version that started it")
    rng = sorted(p.name for p in path.glob("rng_state*.pth"))
    for name in (OPTIMIZER_FILE, SCHEDULER_FILE, *(rng or [rng_file(0, 1)])):
        if not (path / name).is_file():
            raise BituneError(f"checkpoint {path} is incomplete: {name} is missing")
        try:
            torch.load(path / name, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several unrelated types for a damaged file
            raise BituneError(f"corrupt checkpoint file {path / name}: {type(e).__name__}") from e
    read_config(path)
    if model is not None:
        try:
            model.load_weights(path)
        except BituneError:
            raise
        except ValueError as e:
            raise BituneError(str(e)) from e


def non_finite(trainable: dict[str, torch.Tensor], accelerator, sharded: bool = False) -> list[str]:
    """The keys of trained tensors holding inf or NaN, which are never saved. Sharded (FSDP): each process checks
    its shards, and every process gets the same keys."""
    bad = [k for k, p in trainable.items() if not bool(torch.isfinite(sharding.local(p.detach())).all())]
    if sharded:
        flags = accelerator.reduce(torch.tensor([k in bad for k in trainable], device=accelerator.device,
                                                dtype=torch.int32), reduction="sum")
        bad = [k for k, f in zip(trainable, flags.tolist()) if f]
    return bad


def kept_after_divergence(root: Path) -> str:
    """What a run in ``root`` that stopped because it diverged kept, and what to change."""
    found = checkpoints(root)
    kept = f"the last good checkpoint {found[-1]} is kept" if found else "no checkpoint had been written"
    return (f"stopped without saving: {kept} and no final/ is written. Lower lr, raise warmup_ratio or set "
            "max_grad_norm")


__all__ = ["save_checkpoint", "load_checkpoint", "load_rng_state", "verify_checkpoint", "rng_state",
           "set_rng_state", "non_finite", "kept_after_divergence"]
