"""Bitune written straight from the paper (section 2, eq. 1-7): the path to read first.

For left-padded prompts x_1..x_P and right-padded answers y_1..y_A (eos included):

1. Two ordinary Hugging Face forwards over x_1..x_{P-1} fill two KV caches: the causal pass with the causal
   weights, the bidirectional pass with the bidir weights (the ablations change a mask or a weight set:
   ``BituneConfig.passes``).
2. Per layer, the keys and values are mixed (eq. 6-7): ``K = K_causal (1 - a_k) + K_bidir a_k``, ``V`` likewise,
   with ``a = |theta| / (theta_init + |theta|)``, in float32; an indexed layer's indexer keys (DSA) with ``a_k``. In a hybrid model, a recurrent or conv layer runs
   its own causal scan in both passes (on the 2D padding mask) and its final states are mixed the same way with
   their own coefficients: ``S = S_causal (1 - a_s) + S_bidir a_s``, the conv state with ``a_c``.
3. One causal forward with the causal weights reads x_P, y_1..y_{A-1} on top of the mixed cache, positions
   continuing after the prompt's real tokens; its logits predict y_1..y_A.
4. The loss is the example mean (:class:`bitune.outputs.BituneOutput`): each example's mean answer-token
   cross-entropy, averaged over the examples.

Nothing here is fast: every pass runs the whole model (lm_head included), one pass at a time.
:class:`bitune.model.BituneModel` computes the same numbers with early exits, row routing and one fused
forward; tests hold every path to this one. So that a bug in the fast code cannot hide in both, this module
shares none of its helpers: a weight set runs through PEFT's own forward (its public ``set_adapter``), the pass
masks, positions and the mixing are written out here, and only the model's trained tensors (adapters, the
bidir copy of full fine-tuning, the thetas) are read from the BituneModel.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def reference_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, answer_ids: torch.Tensor,
                     answer_mask: torch.Tensor) -> torch.Tensor:
    """(B, A, V) answer logits of a :class:`~bitune.model.BituneModel` computed as the paper states it.

    Args:
        model: the BituneModel (its weight sets, mixer and variant).
        prompt_ids, prompt_mask: (B, P) left-padded prompts, at least 2 real tokens each.
        answer_ids, answer_mask: (B, A) right-padded answers.
    """
    config, text = model.config, model.text_config
    impl = text._attn_implementation
    dtype = next(model.parameters()).dtype
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # (B, T): the prompt without its last token
    if config.single_pass:  # the baselines: one causal pass over prompt + answer
        full_ids, full_mask = torch.cat([prompt_ids, answer_ids], 1), torch.cat([prompt_mask, answer_mask], 1)
        out = _forward(model, "causal", input_ids=full_ids, attention_mask=full_mask, position_ids=_positions(full_mask))
        return out.logits[:, prompt_ids.shape[1] - 1:-1]  # (B, A, V)
    caches = []
    for weight_set, kind in config.passes:  # step 1
        cache = DynamicCache(config=text)
        _forward(model, weight_set, input_ids=ids, attention_mask=_pass_mask(mask, kind, text, impl, dtype),
                 position_ids=_positions(mask), cache=cache, use_cache=True)
        caches.append(cache)
    cache = caches[0]
    if model.mixer is not None:  # step 2
        thetas = dict(model.mixer.named_parameters())
        for layer, (c, b) in enumerate(zip(caches[0].layers, caches[1].layers)):
            for name, theta in (("keys", "theta_k"), ("values", "theta_v"), ("indexer_keys", "theta_k")):
                if isinstance(getattr(c, name, None), torch.Tensor):  # (B, nh, T, hs); an indexer's (B, T, d)
                    a = _ratio(thetas[theta][layer], config.theta_init)
                    setattr(c, name, (getattr(c, name).float() * (1 - a) + getattr(b, name).float() * a).to(
                        getattr(c, name).dtype))
            for name, theta in (("recurrent_states", "theta_s"), ("conv_states", "theta_c")):
                if theta in thetas and isinstance(getattr(c, name, None), dict):  # {state index: (B, ...)}
                    a = _ratio(thetas[theta][layer], config.theta_init)
                    setattr(c, name, {i: x if x is None else (x.float() * (1 - a) + getattr(b, name)[i].float() * a
                                                              ).to(x.dtype) for i, x in getattr(c, name).items()})
    step_ids = torch.cat([prompt_ids[:, -1:], answer_ids[:, :-1]], 1)  # (B, A): x_P, y_1..y_{A-1}
    step_mask = torch.cat([prompt_mask[:, -1:], answer_mask[:, :-1]], 1)  # (B, A)
    full_mask = torch.cat([mask, step_mask], 1)  # (B, T + A)
    out = _forward(model, "causal", input_ids=step_ids, attention_mask=full_mask,  # step 3
                   position_ids=_positions(full_mask)[:, -step_ids.shape[1]:], cache=cache, use_cache=True)
    return out.logits  # (B, A, V)


def _ratio(theta: torch.Tensor, theta_init: float) -> torch.Tensor:
    """Eq. 7: a = |theta| / (theta_init + |theta|), float32."""
    return theta.float().abs() / (theta_init + theta.float().abs())


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) positions counting real tokens only (left padding does not shift them); 0 on padding."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0) * mask.long()


def _pass_mask(mask: torch.Tensor, kind: str, text, impl: str, dtype: torch.dtype):
    """The 4D mask of one prompt pass (eq. 4-5), True/0 where query row q may read key column k: ``causal`` k <= q,
    ``bidirectional`` every k, ``anti_causal`` k >= q; within the sliding window |q - k| < window on sliding
    layers; within the query's chunk (real-token position // chunk size) on chunked layers (Llama 4); never a
    padding key, and always itself (no empty softmax row on a padding query). Boolean for sdpa, additive for eager;
    ``{layer type: mask}`` for models with several layer types. ALiBi models (Bloom, MPT) are given these masks
    too: wrap made their bias symmetric (:func:`bitune.attention.symmetric_alibi`), which this module does not
    re-derive."""
    T = mask.shape[1]
    q = torch.arange(T, device=mask.device)[:, None]  # (T, 1)
    k = torch.arange(T, device=mask.device)[None, :]  # (1, T)
    shape = {"causal": k <= q, "bidirectional": k >= 0, "anti_causal": k >= q}[kind]  # (T, T)

    def build(window, chunk=None):
        ok = shape if window is None else shape & ((q - k).abs() < window)  # (T, T)
        ok = ok & mask.bool()[:, None, None, :]  # (B, 1, T, T)
        if chunk is not None:  # chunked layers: the query's chunk of real-token positions only
            block = _positions(mask) // chunk  # (B, T)
            ok = ok & (block[:, None, :, None] == block[:, None, None, :])
        ok = ok | (q == k)
        return ok if impl == "sdpa" else torch.where(ok, 0.0, torch.finfo(dtype).min).to(dtype)

    types = getattr(text, "layer_types", None) or getattr(text, "layers_block_type", None) or ()
    types, window = set(types), getattr(text, "sliding_window", None)
    if types <= {"full_attention", "sliding_attention"}:  # the masks every attention model takes
        if "sliding_attention" in types:
            return {"full_attention": build(None), "sliding_attention": build(window)}
        return build(window if not types else None)  # sliding everywhere: Mistral

    def form(t):
        if t in SCANNED:  # recurrent and conv layers read the 2D padding mask
            return mask
        if t in UNMASKED:
            return None
        if t == "chunked_attention":  # Llama 4
            return build(None, text.attention_chunk_size)
        return build(window if t == "sliding_attention" else None)

    out = {t: form(t) for t in types}
    if "hybrid" in types:  # attention and an SSM side by side (Falcon-H1) read both
        out.update(full_attention=build(None), linear_attention=mask)
    return out


SCANNED = {"linear_attention", "conv", "mamba"}
"""Layer types of recurrent and conv layers: causal scans that take the (B, T) padding mask, no 4D mask."""
UNMASKED = {"mlp", "moe"}
"""Layer types of blocks without attention or state."""


def _forward(model, weight_set: str, **kwargs):
    """One forward of the wrapped Hugging Face model with ``weight_set``'s weights, through the libraries' own
    forwards: PEFT's model with ``weight_set`` as its active adapter, or (full fine-tuning) the model called
    with the bidir copy of its weights. A variant without that set uses the causal weights."""
    weights = model.weights
    if weight_set not in model.config.weight_sets:
        weight_set = "causal"
    if weights.method == "full" and weight_set == "bidir":
        params = dict(weights.bidir_model.named_parameters())  # the copy's weights on the causal model
        return torch.func.functional_call(weights.model, params, args=(), kwargs=kwargs, strict=False)
    if not weights.peft:
        return weights.model(**kwargs)
    with _active_adapter(weights.model, weight_set):
        return weights.model(**kwargs)


@contextmanager
def _active_adapter(peft_model, name: str):
    """PEFT's ``set_adapter(name)`` for the block. ``set_adapter`` also turns ``requires_grad`` off on the other
    adapters (RESOURCES' trap: a gradient silently lost), so every flag is restored right after the switch, before
    the forward, and again after switching back."""
    flags = [(p, p.requires_grad) for p in peft_model.parameters()]

    def restore():
        for p, flag in flags:
            p.requires_grad_(flag)

    active = peft_model.active_adapter
    peft_model.set_adapter(name)
    restore()
    try:
        yield
    finally:
        peft_model.set_adapter(active)
        restore()


def reference_loss(model, prompt_ids, prompt_mask, answer_ids, answer_mask) -> torch.Tensor:
    """Step 4: the mean over examples of each example's mean answer-token cross-entropy (scalar)."""
    logits = reference_logits(model, prompt_ids, prompt_mask, answer_ids, answer_mask).float()  # (B, A, V)
    tokens = F.cross_entropy(logits.transpose(1, 2), answer_ids, reduction="none")  # (B, A)
    per_example = (tokens * answer_mask).sum(1) / answer_mask.sum(1)  # (B,)
    return per_example.mean()


__all__ = ["reference_logits", "reference_loss"]
