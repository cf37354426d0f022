"""The run folder of ``bitune train``: what it holds, whether this run may write into it, its log and its lock.

A fresh run refuses a folder that already holds a run, ``--resume`` refuses a folder with nothing to resume
or a finished run, and only ``--overwrite`` lets a run replace what is there. While a run trains, its main
process holds an exclusive ``flock`` on ``run.lock`` in the folder: a second ``bitune train`` on the same
folder stops at once with an error. The operating system drops the lock when the process ends, however it
ends (exit, crash, ``kill -9``), so a lock is never stale. Light: no torch, so the CLI checks before loading.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from ..errors import BituneError
from ..files import read_text, write_text_atomic
from .settings import upgrade

CHECKPOINT_PREFIX = "checkpoint-"
STATE_FILE = "trainer_state.json"
"""The small JSON state of a checkpoint (step, epoch, loss sum); written last, so its presence marks a checkpoint."""
RNG_FILE = "rng_state.pth"
"""A one-process checkpoint's RNG states; ``rng_state_<rank>.pth`` per process in a multi-process one."""
LOG_FILE = "log.jsonl"
SETTINGS_FILE = "settings.yaml"
FINAL_DIR = "final"
TB_DIR = "tensorboard"
LOCK_FILE = "run.lock"
RESUMABLE_KEYS = ("output_dir", "steps", "epochs", "save_every", "save_total_limit", "log_every", "eval_every",
                  "num_workers", "prompt_passes")
"""Settings a resumed run may change."""

_held: dict[str, int] = {}  # run folders this process holds the lock of -> the lock file's descriptor


def checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in a run folder, oldest first."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
             if p.is_dir() and p.name[len(CHECKPOINT_PREFIX):].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name[len(CHECKPOINT_PREFIX):])


def describe(out: Path, limit: int = 8) -> str:
    """What a run folder holds, for error messages: ``final/, checkpoint-4/, checkpoint-6/ (incomplete), ...``."""
    if not out.is_dir():
        return "nothing"
    complete = set(checkpoints(out))
    names = []
    for p in sorted(out.iterdir(), key=lambda p: (not p.name.startswith(CHECKPOINT_PREFIX), p.name)):
        if p.name == LOCK_FILE:
            continue
        incomplete = p.name.startswith(CHECKPOINT_PREFIX) and p not in complete
        names.append(p.name + ("/" if p.is_dir() else "") + (" (incomplete)" if incomplete else ""))
    shown = ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
    return shown or "nothing"


def check_run_folder(out: Path, settings: Any, resume: bool, overwrite: bool = False) -> Path | None:
    """Refuse a run that would overwrite or lose another; return the checkpoint to resume from (None: fresh).

    Args:
        out: the run folder.
        settings: this run's :class:`~bitune.train.settings.TrainSettings` (compared with the saved ones on resume).
        resume: ``--resume``: continue from the newest complete checkpoint.
        overwrite: ``--overwrite``: with ``resume``, a finished run may be continued (its ``final/`` replaced);
            without, an existing run is deleted and started afresh (see :func:`clear_run`).

    Raises:
        BituneError: naming the folder and what it holds.
    """
    out = Path(out)
    found = checkpoints(out)
    finished = (out / FINAL_DIR).exists()
    if not resume:
        if (found or finished or (out / LOG_FILE).exists()) and not overwrite:
            hint = f"pass --resume to continue it from {found[-1].name}, " if found and not finished else ""
            raise BituneError(f"{out} already holds a training run ({describe(out)}); {hint}pass --overwrite to "
                              "delete it and start afresh, or choose another output_dir")
        return None
    if not out.is_dir():
        raise BituneError(f"--resume: output_dir {out} does not exist; there is nothing to resume")
    if finished and not overwrite:
        also = f" from {found[-1].name}" if found else ""
        raise BituneError(f"--resume: {out} holds a finished run ({describe(out)}); it is left as it is. Choose "
                          f"another output_dir, or add --overwrite to continue it{also} and replace final/")
    if not found:
        raise BituneError(f"--resume: {out} has no complete checkpoint to resume from (it holds: {describe(out)}); "
                          "run without --resume and with --overwrite to start afresh, or choose another output_dir")
    _check_same_settings(out / SETTINGS_FILE, settings)
    return found[-1]


def _check_same_settings(saved_path: Path, settings: Any) -> None:
    if not saved_path.exists():
        return
    try:
        saved = yaml.safe_load(read_text(saved_path, "saved settings"))
    except yaml.YAMLError as e:
        raise BituneError(f"{saved_path} is corrupt ({' '.join(str(e).split())}); cannot check the run to "
                          "resume") from e
    if not isinstance(saved, dict):
        raise BituneError(f"{saved_path} is corrupt (not a mapping of settings); cannot check the run to resume")
    saved = upgrade(saved)  # an older run's bitune.prompt_passes is a runtime choice, like any resumable key
    now = settings.to_dict()
    changed = sorted(k for k in now if k not in RESUMABLE_KEYS
                     and k in saved and saved[k] != now[k])  # a key an older version did not write: its default
    if changed:
        raise BituneError(f"--resume: settings {changed} differ from the saved run in {saved_path}; "
                          "resume with the same settings or choose another output_dir")


def prepare_output_dir(out: Path, settings: Any, resume: bool, write: bool = True,
                       overwrite: bool = False) -> Path | None:
    """Check the run folder against this run (:func:`check_run_folder`) and write ``settings.yaml``; return the
    checkpoint to resume from. ``write=False`` only checks; with ``overwrite`` and without ``resume`` the old run
    is deleted first."""
    checkpoint = check_run_folder(out, settings, resume, overwrite)
    if not write:
        return checkpoint
    if overwrite and not resume:
        clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / SETTINGS_FILE, settings.to_yaml())
    return checkpoint


def rng_file(rank: int, world_size: int) -> str:
    """The name of one process's RNG-state file in a checkpoint."""
    return RNG_FILE if world_size == 1 else f"rng_state_{rank}.pth"


def checkpoint_world_size(path: Path) -> int:
    """How many processes wrote a checkpoint: one ``rng_state.pth``, or ``rng_state_<rank>.pth`` per process."""
    per_rank = list(Path(path).glob("rng_state_*.pth"))
    return len(per_rank) if per_rank else 1


def check_world_size(path: Path, world_size: int) -> None:
    """Refuse to resume with another process count: the global batch (and so the run) would change."""
    saved = checkpoint_world_size(path)
    if saved != world_size:
        raise BituneError(f"{path} was written by {saved} process(es), this run has {world_size}: the global "
                          f"batch would change; resume with --num-processes {saved} or choose another output_dir")


def rotate(out: Path, keep: int | None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints (``save_total_limit``; None keeps all)."""
    if keep is None:
        return
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON record as a line of ``path`` (creating its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after ``step`` by an interrupted run (they are logged again on resume)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut off by the interruption
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))


def clear_run(out: Path) -> None:
    """Delete what ``bitune train`` wrote into a run folder (``--overwrite`` without ``--resume``)."""
    for p in [*Path(out).glob(f"{CHECKPOINT_PREFIX}*"), *(out / n for n in (FINAL_DIR, TB_DIR))]:
        if p.is_dir():
            shutil.rmtree(p)
    for name in (LOG_FILE, SETTINGS_FILE):
        (out / name).unlink(missing_ok=True)


@contextmanager
def run_lock(output_dir: str | Path) -> Iterator[None]:
    """Hold the exclusive lock of a run folder (creating the folder) for the ``with`` block.

    Nested uses in one process share the lock; only the main process of a multi-process job (``RANK`` 0)
    takes it.

    Raises:
        BituneError: another process holds the lock (names it and the lock file).
    """
    folder = Path(output_dir).expanduser().absolute()
    key = str(folder)
    if key in _held or int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise BituneError(f"output_dir {folder} is in use by another bitune train ({holder}; lock file {path}); "
                          "wait for it to finish or choose another output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _held[key] = fd
    try:
        yield
    finally:
        del _held[key]
        os.close(fd)  # releases the lock; the file stays (removing it could let two later runs lock two files)


__all__ = ["checkpoints", "check_run_folder", "check_world_size", "clear_run", "describe", "prepare_output_dir",
           "rotate", "run_lock", "truncate_log", "append_jsonl", "LOCK_FILE"]
