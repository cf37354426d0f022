"""The training log: one JSON record per line in ``log.jsonl``, the same numbers in TensorBoard, and what a
record sums up since the previous one (:class:`Window`).

A record is ``{"step": N, <numbers>, "batches": [...], "a_k": [...], "a_v": [...], "elapsed_s": s}``: the
digests of the steps' batches since the previous record (:func:`batch_digest`) and the per-layer mixing ratios
of a Bitune model ride along with every record. Only the main process of a multi-process job makes a logger.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import torch

from .run_folder import LOG_FILE, TB_DIR, append_jsonl


class Window:
    """What the next record sums up, gathered step by step since the previous record.

    Attributes:
        loss: this process's step losses summed (a 0-d tensor on the training device; reduced over the
            processes when a record is written).
        steps: the optimizer steps summed in ``loss``.
        positions: ``(real, computed)`` positions of the training batches, the prompt counted once per prompt
            pass (``padding_share``).
        batches: the digests of the steps' batches (:func:`batch_digest`), one per step.
    """

    def __init__(self):
        self.loss, self.steps = torch.zeros(()), 0
        self.positions = (0, 0)
        self.batches: list[str] = []

    def restart(self, device: torch.device | None = None) -> None:
        """Sum the step losses anew (on ``device``; default: where they were summed so far)."""
        self.loss = torch.zeros((), device=device if device is not None else self.loss.device)
        self.steps = 0

    def count_positions(self, inputs: dict[str, torch.Tensor], prompt_passes: int) -> None:
        """Add a batch's real and computed positions (the prompt counted once per prompt pass)."""
        w = max(1, prompt_passes)
        pm, am = inputs["prompt_mask"], inputs["answer_mask"]  # (B, P), (B, A)
        real = w * int(pm.sum()) + int(am.sum())
        computed = w * pm.numel() + am.numel()
        self.positions = (self.positions[0] + real, self.positions[1] + computed)

    def padding_share(self) -> dict[str, float]:
        """``{"padding_share": ...}``: the share of computed positions that were padding (nothing when no batch
        was counted); the count starts anew."""
        real, computed = self.positions
        self.positions = (0, 0)
        return {"padding_share": round(1.0 - real / computed, 4)} if computed else {}

    def take_batches(self) -> list[str]:
        """The digests gathered so far; the list starts anew."""
        batches, self.batches = self.batches, []
        return batches


def batch_digest(group: list[dict[str, torch.Tensor]]) -> str:
    """A 12-hex-digit digest of one optimizer step's examples (this process's micro-batches): each row's real
    prompt and answer tokens, in order, padding left out. Two runs took the same batches at a step exactly when
    their digests agree (``log.jsonl``'s ``batches``: one digest per step since the previous record)."""
    h = hashlib.blake2b(digest_size=6)
    for inputs in group:
        rows = zip(inputs["prompt_ids"], inputs["prompt_mask"], inputs["answer_ids"], inputs["answer_mask"])
        for pi, pm, ai, am in rows:
            for ids, mask in ((pi, pm), (ai, am)):
                h.update(ids[mask.bool()].to(torch.int64).cpu().numpy().tobytes())
                h.update(b"|")
    return h.hexdigest()


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


__all__ = ["JsonlLogger", "Window", "batch_digest"]
