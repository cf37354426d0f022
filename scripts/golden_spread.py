"""Where the stored numbers land on this CPU: the golden weight sums (tests/test_train.py) and golden reference
losses (tests/test_reference.py) as computed here, and their largest distance from the stored values.

Run it under other kernels and thread counts to see how far float32 rounding moves them (the tolerances next to
GOLDEN in both test files are derived from this spread)::

    for cap in default avx2 avx512; do for t in 1 2; do
      ATEN_CPU_CAPABILITY=$cap OMP_NUM_THREADS=$t PYTHONPATH=src .venv/bin/python scripts/golden_spread.py
    done; done
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))

import test_reference  # noqa: E402
import test_train  # noqa: E402
from bitune.reference import reference_loss  # noqa: E402
from helpers.models import batch  # noqa: E402


def main() -> None:
    sums, losses = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, shape in enumerate(test_train.GOLDEN):
            sums[str(shape)] = test_train.golden_sums(Path(tmp) / str(i), *shape)
    for variant in sorted(test_reference.GOLDEN):
        model = test_reference._model("llama", "sdpa", variant, scale=0.3)
        with torch.no_grad():
            losses[variant] = reference_loss(model, *batch(**test_reference.TENSORS)).item()
    weight_gap = max(abs(a - b) for shape, got in zip(test_train.GOLDEN, sums.values())
                     for a, b in zip(got, test_train.GOLDEN[shape]))
    loss_gap = max(abs(losses[v] - g) for v, g in test_reference.GOLDEN.items())
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                      "weight_sums": sums, "losses": losses, "max_weight_sum_gap": weight_gap,
                      "max_loss_gap": loss_gap}))


if __name__ == "__main__":
    from bitune.cli import run_script

    sys.exit(run_script("golden spread", main))
