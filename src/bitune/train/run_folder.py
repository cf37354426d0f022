"""The run folder of ``bitune train``: what it holds, whether this run may write into it, its log and its lock.

:func:`start_run` is the one place a run takes its folder, where the run starts: it locks the folder, checks it
once against this run and, if the start fails before the run has written anything (an unknown model, no example
that fits, ...), removes what the start created (the lock file, the folder). A fresh run refuses a folder that
already holds a run, ``--resume`` refuses a folder with nothing to resume or a finished run, and only
``--overwrite`` lets a run replace what is there. While a run trains, its main process holds an exclusive
``flock`` on ``run.lock`` in the folder: a second ``bitune train`` on the same folder stops at once with an
error. The operating system drops the lock when the process ends, however it ends (exit, crash, ``kill -9``),
so a lock is never stale; a run that ends (finished or failed) also removes the file, which a ``kill -9`` leaves
behind, unlocked. Light: no torch.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ..config import RECORDED_DEFAULTS
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
START_ONLY_KEYS = ("bitune.init_share",)
"""Settings that only decide a fresh run's start (the checkpoint replaces what they set): on ``--resume`` one the
user did not name takes the saved run's value, so a run saved under an older default continues as it began."""


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
    check_inputs_outside(out, {"model": settings.model, "dataset": settings.dataset})
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


def written(out: Path) -> list[Path]:
    """What a run writes into (and ``--overwrite``, a resumed run or rotation may replace or delete) in ``out``:
    its checkpoints, ``final/``, ``tensorboard/``, the log, the settings and the lock."""
    names = (FINAL_DIR, TB_DIR, LOG_FILE, SETTINGS_FILE, LOCK_FILE)
    return [*Path(out).glob(f"{CHECKPOINT_PREFIX}*"), *(Path(out) / name for name in names)]


def check_inputs_outside(out: Path, inputs: dict[str, str]) -> None:
    """Refuse a run whose inputs (the base model folder, the data file) are, or lie inside, something the run
    writes into its folder (:func:`written`): it would replace or delete what it reads. A built-in or hub name is
    no path and passes; the rest of the folder (a ``base/`` or ``data.jsonl`` beside the run's files) is never
    touched by a run.

    Raises:
        BituneError: naming the setting, the path and what of the run folder it lies in.
    """
    targets = [p.expanduser().resolve() for p in written(out)]
    for name, value in inputs.items():
        path = Path(value).expanduser()
        if not value or not path.exists():
            continue
        path = path.resolve()
        for target in targets:
            if path == target or target in path.parents:
                raise BituneError(f"{name}={value} lies in {target.name} of output_dir {out}, which a run writes "
                                  "(and --overwrite deletes): move it out of the run's files, or choose another "
                                  "output_dir")


def _check_same_settings(saved_path: Path, settings: Any) -> None:
    """Refuse a resume whose settings differ from the saved run's, naming each differing key (dotted inside a
    section: ``bitune.init_share``). A key the saved run does not record takes what it was made with
    (:data:`~bitune.config.RECORDED_DEFAULTS` for the ``bitune`` section; otherwise it is not compared). A
    setting that only decides the fresh start (:data:`START_ONLY_KEYS`) and that this run's configs and
    ``--set`` did not name takes the saved run's value (``settings.given``: the dotted keys they named)."""
    if not saved_path.exists():
        return
    try:
        saved = yaml.safe_load(read_text(saved_path, "saved settings"))
    except yaml.YAMLError as e:
        raise BituneError(f"{saved_path} is corrupt ({' '.join(str(e).split())}); cannot check the run to "
                          "resume") from e
    if not isinstance(saved, dict):
        raise BituneError(f"{saved_path} is corrupt (not a mapping of settings); cannot check the run to resume")
    saved = _flat(upgrade(saved))  # an older run's bitune.prompt_passes is a runtime choice, like any resumable key
    saved = {**{f"bitune.{k}": v for k, v in RECORDED_DEFAULTS.items()}, **saved}
    given = getattr(settings, "given", None)  # None: every setting counts as named
    changed = []
    for key, value in _flat(settings.to_dict()).items():
        if key in RESUMABLE_KEYS or key not in saved or saved[key] == value:  # unrecorded: its default
            continue
        if key in START_ONLY_KEYS and given is not None and key not in given:
            section, _, name = key.partition(".")
            setattr(settings, section, replace(getattr(settings, section), **{name: saved[key]}))
            continue
        changed.append(f"{key} (saved {saved[key]!r}, now {value!r})")
    if changed:
        raise BituneError(f"--resume: settings {', '.join(changed)} differ from the saved run in {saved_path}; "
                          "resume with the same settings or choose another output_dir")


def _flat(data: dict[str, Any]) -> dict[str, Any]:
    """Settings with the ``bitune`` section's keys dotted (``bitune.init_share``), the rest as they are."""
    section = data.get("bitune")
    out = {k: v for k, v in data.items() if k != "bitune" or not isinstance(section, dict)}
    if isinstance(section, dict):
        out.update({f"bitune.{k}": v for k, v in section.items()})
    return out


@dataclass
class RunStart:
    """A run that holds its folder (from :func:`start_run`): what to resume from, and the step that writes."""

    out: Path
    """The run folder."""
    checkpoint: Path | None
    """The checkpoint to resume from (None: a fresh run)."""
    settings: Any = field(repr=False)
    resume: bool = False
    overwrite: bool = False
    begun: bool = False
    """Whether :meth:`begin` ran: from then on a failure keeps the folder (its checkpoints and log)."""

    def begin(self) -> None:
        """Start writing (main process): delete the old run when ``overwrite`` starts afresh, write
        ``settings.yaml``."""
        if self.overwrite and not self.resume:
            kept = clear_run(self.out)
            if kept:
                print(f"bitune train: --overwrite deleted the old run in {self.out} and kept {', '.join(kept)} "
                      "(not written by a run)", file=sys.stderr)
        self.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.out / SETTINGS_FILE, self.settings.to_yaml())
        self.begun = True


@contextmanager
def start_run(out: str | Path, settings: Any, resume: bool, overwrite: bool = False,
              main: bool = True) -> Iterator[RunStart]:
    """Take a run folder for the ``with`` block: lock it (main process only), check it against this run
    (:func:`check_run_folder`, once) and yield the :class:`RunStart`. A failure before :meth:`RunStart.begin`
    (loading the model or the data, building the trainer) removes what the start created: the lock file and
    the folders it made (never a file it did not create).

    Raises:
        BituneError: the folder is locked by another run, or holds a run this one may not replace or resume.
    """
    out = Path(out)
    created = _missing(out.expanduser().absolute())  # the folders locking creates, outermost first
    lock = out.expanduser().absolute() / LOCK_FILE
    lock_existed = lock.exists()
    with run_lock(out) if main else nullcontext():
        run = RunStart(out, None, settings, resume, overwrite)
        try:
            run.checkpoint = check_run_folder(out, settings, resume, overwrite)
            yield run
        except BaseException:
            if main and not run.begun:
                if not lock_existed:
                    lock.unlink(missing_ok=True)  # still locked: a process waiting on it retries (see run_lock)
                for folder in reversed(created):
                    with suppress(OSError):
                        folder.rmdir()  # only when empty
            raise


def _missing(folder: Path) -> list[Path]:
    """``folder`` and those of its ancestors that do not exist, outermost first."""
    missing = []
    while not folder.exists() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    return missing[::-1]


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
    for line in read_text(path, "training log").splitlines():
        try:
            logged = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off by the interruption
        at = logged.get("step", 0) if isinstance(logged, dict) else None
        if not isinstance(at, int) or at <= step:  # a line that is no step's record is kept as it is
            kept.append(line)
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))


def clear_run(out: Path) -> list[str]:
    """Delete what ``bitune train`` wrote into a run folder (``--overwrite`` without ``--resume``); return the
    names of the entries it kept (the user's, e.g. a base model folder or a data file beside the run)."""
    out = Path(out)
    for p in [*out.glob(f"{CHECKPOINT_PREFIX}*"), *(out / n for n in (FINAL_DIR, TB_DIR))]:
        if p.is_dir():
            shutil.rmtree(p)
    for name in (LOG_FILE, SETTINGS_FILE):
        (out / name).unlink(missing_ok=True)
    ours = {p.name for p in written(out)}
    return sorted(p.name for p in out.iterdir() if p.name not in ours) if out.is_dir() else []


@contextmanager
def run_lock(output_dir: str | Path) -> Iterator[None]:
    """Hold the exclusive lock of a run folder (creating the folder) for the ``with`` block; only the main
    process of a multi-process job (``RANK`` 0) takes it. Use :func:`start_run` to start a run.

    Raises:
        BituneError: another process holds the lock (names it and the lock file).
    """
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    folder = Path(output_dir).expanduser().absolute()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise BituneError(f"output_dir {folder} is in use by another bitune train ({holder}; lock file {path}); "
                              "wait for it to finish or choose another output_dir") from None
        if _same_file(fd, path):
            break
        os.close(fd)  # a failed start removed the file this descriptor locks: lock the file now there
    else:
        raise BituneError(f"output_dir {folder}: could not lock {path} (it keeps being removed); try again")
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    try:
        yield
    finally:
        if _same_file(fd, path):  # removed while still held: a process that opened it meanwhile retries anew
            path.unlink(missing_ok=True)  # a run that ended leaves no file naming a dead pid
        os.close(fd)  # releases the lock


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open descriptor ``fd`` is the file at ``path`` (not one removed since it was opened)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


__all__ = ["checkpoints", "check_run_folder", "check_world_size", "clear_run", "describe", "RunStart", "start_run",
           "rotate", "run_lock", "truncate_log", "append_jsonl", "LOCK_FILE"]
