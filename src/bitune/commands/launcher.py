"""``--num-processes N``: run a verb data-parallel in N local processes through torch's elastic launcher.

``bitune train`` and ``bitune eval`` relaunch themselves as ``python -m bitune.cli VERB ...`` in N processes
(``torch.distributed.run``'s machinery, called in this process). What the user sees is what one process would
show: rank 0's output live (progress bars included), and when the job fails, its error once and the exit status of
the failure (2 for a user error), never the launcher's ``ChildFailedError`` traceback or the same error from every
rank. The other ranks' output goes to a temporary log folder and is shown only where it adds something: their
error when rank 0 did not fail on its own, or the end of an unexpected crash.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

from ..errors import BituneError
from ..processes import ERROR_DIR_ENV, world_size

LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
"""Loggers whose warnings (closing signals, per-rank failure lines) repeat what the ranks' own errors say."""
TAIL = 20
"""Lines of a crashed rank's output shown when its failure is not a one-line user error."""


def launch_args(num_processes: int, argv: list[str], log_dir: str) -> list[str]:
    """``torch.distributed.run``'s arguments for ``num_processes`` copies of ``python -m bitune.cli ARGV``: rank 0
    writes to the terminal, the other ranks to ``log_dir``."""
    others = ",".join(f"{rank}:3" for rank in range(1, num_processes))
    return ["--standalone", f"--nproc_per_node={num_processes}", "--log-dir", log_dir,
            *(["--redirects", others] if others else []), "-m", "bitune.cli", *argv]


def launch(num_processes: int, argv: list[str]) -> int:
    """Run ``bitune ARGV`` data-parallel in ``num_processes`` local processes; returns the exit status.

    On GPUs each process takes one device (nccl); on CPU the processes talk over gloo and share the cores
    (``OMP_NUM_THREADS`` = cores / processes unless set).

    Returns:
        0 when every process succeeded; else the failure's status (2: a user error, which has been printed once).

    Raises:
        BituneError: already inside a launched job, or more processes than visible GPUs.
    """
    import torch  # here, not at the top: help and settings validation do not load torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if world_size() > 1:
        raise BituneError(f"--num-processes: already running in a launched job (WORLD_SIZE={world_size()}); "
                          "drop --num-processes under torchrun or accelerate launch")
    if torch.cuda.is_available() and num_processes > torch.cuda.device_count():
        raise BituneError(f"--num-processes {num_processes}: only {torch.cuda.device_count()} GPU(s) visible")
    threads_set = "OMP_NUM_THREADS" in os.environ
    if not torch.cuda.is_available() and not threads_set:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // num_processes))
    levels = {name: logging.getLogger(name).level for name in LAUNCHER_LOGGERS}
    with tempfile.TemporaryDirectory(prefix="bitune-launch-") as logs:
        try:
            for name in LAUNCHER_LOGGERS:
                logging.getLogger(name).setLevel(logging.CRITICAL)
            os.environ[ERROR_DIR_ENV] = logs  # each process leaves its error line here (bitune.cli.report_error)
            run(get_args_parser().parse_args(launch_args(num_processes, argv, logs)))
            return 0
        except ChildFailedError as e:
            return report_failure({rank: f.exitcode for rank, f in e.failures.items()}, Path(logs))
        finally:
            for name, level in levels.items():
                logging.getLogger(name).setLevel(level)
            os.environ.pop(ERROR_DIR_ENV, None)
            if not threads_set:
                os.environ.pop("OMP_NUM_THREADS", None)


def report_failure(exitcodes: dict[int, int], logs: Path) -> int:
    """Show what rank 0 did not show already, once; returns the job's exit status.

    Every rank that failed through bitune's error boundary left its one error line as ``logs/error-<rank>.txt``
    (:func:`bitune.cli.report_error`); rank 0 also printed it to the terminal. Each line rank 0 did not print is
    shown once (a user error is usually the same bad setting in every rank). A rank that failed without an error
    line (a crash below Python) shows the end of its output.

    Args:
        exitcodes: each failed rank's exit code (negative: killed by that signal, e.g. when another rank failed
            first and the launcher stopped the rest).
        logs: the launcher's log folder (``<run>/attempt_0/<rank>/stderr.log``).

    Returns:
        2 when every rank that failed on its own failed with a user error (status 2), else 1.
    """
    def read(files) -> list[str]:
        return [line for f in sorted(files) for line in f.read_text(encoding="utf-8", errors="replace").splitlines()]

    own = {rank: code for rank, code in exitcodes.items() if code > 0}  # not stopped by the launcher
    shown = set(read(logs.glob("error-0.txt")))
    for rank in sorted(own):
        if rank == 0:
            continue
        errors = read(logs.glob(f"error-{rank}.txt"))
        for line in errors:
            if line not in shown:
                print(line, file=sys.stderr)
                shown.add(line)
        if not errors:
            print(f"bitune: process {rank} failed (exit status {own[rank]}); its last lines:", file=sys.stderr)
            print("\n".join(read(logs.glob(f"*/attempt_*/{rank}/std*.log"))[-TAIL:]), file=sys.stderr)
    return 2 if own and all(code == 2 for code in own.values()) else 1


__all__ = ["launch", "launch_args", "report_failure"]
