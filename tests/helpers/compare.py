"""Snapshots and comparisons of a model's trainable weights (or any dict of tensors, such as gradients)."""

from __future__ import annotations

import torch


def trainable(model) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s trainable parameters (a ``BituneModel``), by name."""
    return {k: p.detach().clone() for k, p in model.trainable_parameters().items()}


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, atol: float) -> None:
    """The same names, and every tensor within ``atol`` of the expected one (absolute, ``rtol=0``; ``atol=0``: bit
    for bit). A failure names the missing or extra names, or the tensor and its largest difference."""
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    assert not missing and not extra, f"missing: {missing}, extra: {extra}"
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
