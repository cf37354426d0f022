"""What both trainers of a :class:`~bitune.model.BituneModel` share: ``bitune train``'s loop
(:mod:`bitune.train.trainer`) and TRL's ``BituneSFTTrainer`` (:mod:`bitune.trl.trainer`) take their optimizer's
parameter groups, their example order and their check of the training loss from here, so the two train alike.

Examples are tokenized samples with ``prompt_ids`` and ``answer_ids`` token lists
(:func:`bitune.data.collate.tokenize_dataset`): a list of such dicts, or a ``datasets.Dataset`` with those columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils.data import Sampler

from ..data.sampling import LengthGroupedSampler, ShuffledSampler
from ..errors import BituneError


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """The optimizer's parameter groups: exactly ``model.trainable_parameters()``, ``weight_decay`` on all but the
    mixer's thetas, which are not decayed (empty groups left out).

    Args:
        model: the :class:`~bitune.model.BituneModel` to train.
        weight_decay: the decay of the adapters (or of the full weights).

    Raises:
        BituneError: the variant has no trainable parameters.
    """
    params = list(model.trainable_parameters().values())
    if not params:
        raise BituneError(f"variant {model.config.variant!r} has no trainable parameters")
    mixer = {id(p) for p in model.mixer.parameters()} if model.mixer is not None else set()
    groups = [{"params": [p for p in params if id(p) not in mixer], "weight_decay": weight_decay},
              {"params": [p for p in params if id(p) in mixer], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def example_lengths(data) -> list[tuple[int, int]]:
    """``(prompt tokens, answer tokens)`` of every example (a ``datasets.Dataset`` is read by column)."""
    if getattr(data, "column_names", None) is not None:
        return [(len(p), len(a)) for p, a in zip(data["prompt_ids"], data["answer_ids"])]
    return [(len(x["prompt_ids"]), len(x["answer_ids"])) for x in data]


def sampler(data: Sequence, seed: int, group: int | None) -> Sampler[int]:
    """The example order, determined by ``seed`` and the epoch only (the same in every process and after a resume).

    Args:
        data: the tokenized examples.
        seed: the order's seed.
        group: the global batch (per-process batch x processes) to group by prompt and answer length
            (:class:`~bitune.data.sampling.LengthGroupedSampler`: accelerate hands consecutive per-process batches
            to processes 0..N-1, so N processes take the examples of one process with batch N x per-process batch);
            None: uniformly shuffled (:class:`~bitune.data.sampling.ShuffledSampler`).
    """
    if group is None:
        return ShuffledSampler(len(data), seed)
    return LengthGroupedSampler(example_lengths(data), group, seed=seed)


def check_loss(loss: torch.Tensor, step: int, then: Callable[[], str]) -> None:
    """Stop a run whose training loss is inf or NaN, before its step is taken.

    Args:
        loss: the training loss of a micro-batch.
        step: the optimizer step being computed (1-based).
        then: what was kept and what to do, for the message (called only when the loss is not finite).

    Raises:
        BituneError: ``training diverged at step N: the training loss is nan; <then>``.
    """
    value = loss.detach()
    if not bool(torch.isfinite(value)):
        raise BituneError(diverged(step, f"the training loss is {float(value)}", then()))


def diverged(step: int, what: str, then: str) -> str:
    """The message of a run stopped because it diverged at ``step``: what happened, then what was kept and what to
    do."""
    return f"training diverged at step {step}: {what}; {then}"


__all__ = ["check_loss", "diverged", "example_lengths", "parameter_groups", "sampler"]
