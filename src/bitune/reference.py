"""Bitune written straight from the paper (section 2, eq. 1-7): the path to read first.

For left-padded prompts x_1..x_P and right-padded answers y_1..y_A (eos included):

1. Two ordinary Hugging Face forwards over x_1..x_{P-1} fill two KV caches: pass A causal with the causal
   weights, pass B bidirectional with the bidir weights (the ablations change a mask or a weight set:
   ``BituneConfig.passes``). Masks come from :func:`bitune.masks.pass_mask`.
2. Per layer, the keys and values are mixed (eq. 6-7): ``K = K_A (1 - a_k) + K_B a_k``, ``V`` likewise, with
   ``a = |theta| / (theta_init + |theta|)`` (:class:`bitune.mixer.Mixer`, float32).
3. One causal forward with the causal weights reads x_P, y_1..y_{A-1} on top of the mixed cache, positions
   continuing after the prompt's real tokens; its logits predict y_1..y_A.
4. The loss is each example's mean answer-token cross-entropy, averaged over the examples.

Nothing here is fast: every pass runs the whole model (lm_head included), one pass at a time.
:class:`bitune.model.BituneModel` computes the same numbers with early exits, row routing and one fused
forward; tests hold every path to this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .masks import pass_mask, position_ids


def reference_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, answer_ids: torch.Tensor,
                     answer_mask: torch.Tensor) -> torch.Tensor:
    """(B, A, V) answer logits of a :class:`~bitune.model.BituneModel` computed as the paper states it.

    Args:
        model: the BituneModel (its weight sets, mixer and variant).
        prompt_ids, prompt_mask: (B, P) left-padded prompts, at least 2 real tokens each.
        answer_ids, answer_mask: (B, A) right-padded answers.
    """
    config, weights, text = model.config, model.weights, model.text_config
    impl = weights.base.config._attn_implementation
    dtype = next(weights.base.parameters()).dtype
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # (B, T): the prompt without its last token
    if config.single_pass:  # the baselines: one causal pass over prompt + answer
        full_ids, full_mask = torch.cat([prompt_ids, answer_ids], 1), torch.cat([prompt_mask, answer_mask], 1)
        out = weights.call("causal", input_ids=full_ids, attention_mask=full_mask,
                           position_ids=position_ids(full_mask))
        return out.logits[:, prompt_ids.shape[1] - 1:-1]  # (B, A, V)
    caches = []
    for weight_set, kind in config.passes:  # step 1
        cache = DynamicCache(config=text)
        weights.call(weight_set, input_ids=ids, attention_mask=pass_mask(mask, kind, dtype, text, impl),
                     position_ids=position_ids(mask), cache=cache, use_cache=True)
        caches.append(cache)
    cache = caches[0]
    if model.mixer is not None:  # step 2
        for layer, (a, b) in enumerate(zip(caches[0].layers, caches[1].layers)):
            a.keys, a.values = model.mixer(layer, a.keys, b.keys, a.values, b.values)
    step_ids = torch.cat([prompt_ids[:, -1:], answer_ids[:, :-1]], 1)  # (B, A): x_P, y_1..y_{A-1}
    step_mask = torch.cat([prompt_mask[:, -1:], answer_mask[:, :-1]], 1)  # (B, A)
    full_mask = torch.cat([mask, step_mask], 1)  # (B, T + A)
    out = weights.call("causal", input_ids=step_ids, attention_mask=full_mask,  # step 3
                       position_ids=position_ids(full_mask)[:, -step_ids.shape[1]:], cache=cache,
                       use_cache=True)
    return out.logits  # (B, A, V)


def reference_loss(model, prompt_ids, prompt_mask, answer_ids, answer_mask) -> torch.Tensor:
    """Step 4: the mean over examples of each example's mean answer-token cross-entropy (scalar)."""
    logits = reference_logits(model, prompt_ids, prompt_mask, answer_ids, answer_mask).float()  # (B, A, V)
    tokens = F.cross_entropy(logits.transpose(1, 2), answer_ids, reduction="none")  # (B, A)
    per_example = (tokens * answer_mask).sum(1) / answer_mask.sum(1)  # (B,)
    return per_example.mean()


__all__ = ["reference_logits", "reference_loss"]
