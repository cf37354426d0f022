"""What a forward returns: :class:`BituneOutput`, the answer tokens' log-probabilities and the loss (the example
mean; :class:`BituneOutput`'s ``loss`` is the one place it is explained)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class BituneOutput:
    """Result of :meth:`bitune.model.BituneModel.forward` for B examples with answers of up to A tokens, vocabulary
    size V.

    Attributes:
        loss: the training loss (scalar), the **example mean**: the mean over the B examples of each example's
            mean answer-token cross-entropy (``example_loss.mean()``). Every example weighs the same whatever its
            length (a token mean would let long answers outweigh short ones), as in the authors' batch-1 x
            gradient-accumulation setup. This is what ``bitune train`` and the TRL trainer optimise; this is the
            one place it is explained, the others point here.
        logits: (B, A, V) ``logits[:, t]`` predicts ``answer_ids[:, t]``.
        token_logprobs: (B, A) log-probability of each answer token (0 on padding).
        example_loss: (B,) mean cross-entropy per example.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    token_logprobs: torch.Tensor
    example_loss: torch.Tensor


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, A) float32 log-probability of each token ``ids[:, t]`` under ``logits[:, t]`` (B, A, V); 0 where ``mask``
    is 0."""
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, A)
    return logp * mask.to(torch.float32)


def answer_loss(logits: torch.Tensor, answer_ids: torch.Tensor, answer_mask: torch.Tensor) -> BituneOutput:
    """The output of a forward from its (B, A, V) answer logits: the example-mean loss (:class:`BituneOutput`),
    the (B, A) token log-probabilities and the (B,) per-example losses of the (B, A) answers."""
    logp = token_logprobs(logits, answer_ids, answer_mask)  # (B, A)
    example_loss = -logp.sum(1) / answer_mask.to(torch.float32).sum(1)  # (B,)
    return BituneOutput(loss=example_loss.mean(), logits=logits, token_logprobs=logp, example_loss=example_loss)


__all__ = ["BituneOutput", "token_logprobs", "answer_loss"]
