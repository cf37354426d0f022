"""The validation loss of a run: ``eval_loss`` in ``log.jsonl`` (every ``eval_every`` steps and at the end)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader


def eval_loss(model: torch.nn.Module, data: list[dict], batch_size: int, collator, accelerator) -> float:
    """The mean over the validation examples of each example's loss, in eval mode without gradients (the model
    is put back in training mode after).

    Args:
        model: the model as trained (DDP-wrapped or sharded), called as a :class:`~bitune.model.BituneModel`.
        data: tokenized validation examples.
        batch_size: examples per batch and process.
        collator: turns a list of examples into ``prompt_ids, prompt_mask, answer_ids, answer_mask``.
        accelerator: accelerate's ``Accelerator``: each process evaluates its share, the losses are gathered.
    """
    loader = accelerator.prepare_data_loader(DataLoader(data, batch_size=batch_size, shuffle=False,
                                                        collate_fn=collator))
    losses = []
    model.eval()
    with torch.no_grad():
        for b in loader:
            out = model(b["prompt_ids"], b["prompt_mask"], b["answer_ids"], b["answer_mask"])
            losses.append(accelerator.gather_for_metrics(out.example_loss.detach().float()))  # (B * processes,)
    model.train()
    return float(torch.cat(losses).mean())
