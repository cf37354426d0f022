"""Gradient clipping and the gradient norms ``log.jsonl`` records for every logged step.

The trainable parameters are grouped by the prefix of their keys in ``BituneModel.trainable_parameters()``:
``causal`` and ``bidir`` (the two weight sets) and ``mixer`` (the thetas). ``clip: all`` clips them together,
``clip: adapters`` only the two weight sets; sharded gradients (FSDP) are measured and clipped over all processes
(:mod:`.sharding`).
"""

from __future__ import annotations

import math

import torch

from . import sharding


def clip_gradients(trainable: dict[str, torch.Tensor], clip: str, max_grad_norm: float) -> dict[str, float]:
    """Clip as ``clip`` says (``all`` trainable parameters together, or only the ``adapters``) to ``max_grad_norm``
    (0: no clipping) and return the gradient norms the log records.

    Args:
        trainable: the model's trainable parameters by key (``"causal:..."``, ``"bidir:..."``, ``"mixer:..."``).
        clip: ``"all"`` or ``"adapters"``.
        max_grad_norm: the largest global norm the clipped gradients keep; 0 for no clipping.

    Returns:
        ``grad_norm``: the global norm of every trainable gradient before clipping; per group present
            (``causal`` and ``bidir`` adapters, ``mixer``) its norm before clipping ``grad_norm_<group>`` and
            after ``grad_norm_<group>_clipped``; ``grad_norm_adapters``: both adapter sets together, before;
            ``clip_factor``: what the clipped gradients were multiplied by (torch's ``max_grad_norm / (norm +
            1e-6)`` capped at 1; 1 without clipping). A clipped group's after-norm is ``clip_factor`` times
            its before-norm; an unclipped one's (the mixer under ``clip: adapters``) is its before-norm.
    """
    groups: dict[str, list[torch.Tensor]] = {}
    for key, p in trainable.items():
        groups.setdefault(key.partition(":")[0], []).append(p)
    adapters = [p for name in ("causal", "bidir") for p in groups.get(name, [])]
    before = {name: sharding.total_norm(ps) for name, ps in groups.items()}
    everything = [p for ps in groups.values() for p in ps]
    factor = 1.0
    clipped = everything if clip == "all" else adapters
    total = sharding.total_norm(everything)
    if max_grad_norm > 0 and clipped:
        norm = sharding.clip(clipped, max_grad_norm)  # the clipped parameters' norm before clipping
        factor = min(1.0, max_grad_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_ scales
    norms = {"grad_norm": total, "clip_factor": factor}
    if adapters:
        norms["grad_norm_adapters"] = math.hypot(before.get("causal", 0.0), before.get("bidir", 0.0))
    for name, ps in groups.items():
        norms[f"grad_norm_{name}"] = before[name]
        norms[f"grad_norm_{name}_clipped"] = sharding.total_norm(ps)
    return norms
