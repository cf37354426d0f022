"""The training log: one JSON record per line in ``log.jsonl``, the same numbers in TensorBoard.

A record is ``{"step": N, <numbers>, "batches": [...], "a_k": [...], "a_v": [...], "elapsed_s": s}``: the
digests of the steps' batches since the previous record (:func:`bitune.train.trainer.batch_digest`) and the
per-layer mixing ratios of a Bitune model ride along with every record. Only the main process of a multi-process job makes a logger.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .run_folder import LOG_FILE, TB_DIR, append_jsonl


class JsonlLogger:
    """Writes records to ``output_dir/log.jsonl`` and (when installed and asked for) ``output_dir/tensorboard``."""

    def __init__(self, output_dir: Path, tensorboard: bool = True):
        self.path = output_dir / LOG_FILE
        self.tb_dir = output_dir / TB_DIR
        self.use_tb = tensorboard
        self.writer = None
        self.start = time.time()

    def open(self) -> None:
        """Start the TensorBoard writer (once); without tensorboard installed, log to ``log.jsonl`` only."""
        if not self.use_tb or self.writer is not None:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("bitune train: tensorboard is not installed; logging to log.jsonl only")
            self.use_tb = False
        else:
            self.writer = SummaryWriter(str(self.tb_dir))

    def log(self, step: int, values: dict[str, Any], ratios: dict[str, Any] | None = None) -> dict[str, Any]:
        """Append one record: ``values``' numbers, the mixing ratios (``{"k": (L,), "v": (L,)}``), the time since
        start."""
        record: dict[str, Any] = {"step": step}
        record.update({k: v for k, v in values.items() if isinstance(v, (int, float)) or _strings(v)})
        for k, layer_ratios in (ratios or {}).items():  # (L,) each
            record[f"a_{k}"] = [round(float(a), 6) for a in layer_ratios]
        record["elapsed_s"] = round(time.time() - self.start, 2)
        append_jsonl(self.path, record)
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(f"train/{k}", v, step)
                elif k.startswith("a_"):
                    for i, a in enumerate(v):
                        self.writer.add_scalar(f"mixing/{k}/layer_{i:02d}", a, step)
            self.writer.flush()
        return record

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _strings(value: Any) -> bool:
    """A list of strings (``batches``: the digests of the steps' batches) is logged as it is."""
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


__all__ = ["JsonlLogger"]
