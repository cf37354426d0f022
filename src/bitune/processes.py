"""How many processes this job runs in, read in one place (no torch import: the CLI's checks use it).

torchrun and ``accelerate launch`` set ``WORLD_SIZE`` in every process they start; ``bitune train --num-processes``
and ``bitune eval --num-processes`` start their processes through the same launcher (:mod:`bitune.commands.launcher`).
"""

from __future__ import annotations

import os

from .errors import BituneError

ERROR_DIR_ENV = "BITUNE_LAUNCH_ERRORS"
"""Set by the ``--num-processes`` launcher: the folder where each launched process leaves its error line."""


def world_size() -> int:
    """Processes in this job: ``WORLD_SIZE`` as torchrun and accelerate set it (1 outside a launched job).

    Raises:
        BituneError: ``WORLD_SIZE`` is set but not a positive integer.
    """
    value = os.environ.get("WORLD_SIZE", "1").strip()
    if not value.isdigit() or int(value) < 1:
        raise BituneError(f"WORLD_SIZE={value!r} is not a positive number of processes")
    return int(value)


def check_fsdp_processes(processes: int) -> None:
    """FSDP shards over several processes: refuse a sharded run of one.

    Args:
        processes: the processes the run has (or will have, once launched).

    Raises:
        BituneError: ``processes`` < 2.
    """
    if processes < 2:
        raise BituneError("fsdp shards over several processes; this run has one: add --num-processes N, or run "
                          "under torchrun or accelerate launch")


__all__ = ["ERROR_DIR_ENV", "check_fsdp_processes", "world_size"]
