"""Activation checkpointing per decoder layer (``gradient_checkpointing: true``): the prompt caches are kept and
nothing is written into them twice, so loss and gradients equal the run without it, on every path (fused,
batched, sequential), for every method, with sliding-window layers (Gemma 3) too, and activations are
recomputed (fewer tensors saved for the backward)."""

from __future__ import annotations

import pytest
import torch

from bitune import BituneModel
from bitune.config import BituneConfig
from bitune.errors import BituneError
from conftest import batch, perturb_adapters, tiny_model

CASES = [("llama", "bitune", "lora", "fused"), ("llama", "bitune", "lora", "batched"),
         ("llama", "bitune", "lora", "sequential"), ("gemma3", "bitune", "lora", "fused"),
         ("gemma3", "bitune", "lora", "sequential"), ("llama", "bitune", "full", "auto"),
         ("llama", "bitune", "dora", "auto"), ("llama", "bitune", "ia3", "auto"),
         ("llama", "no_mixing", "lora", "auto"), ("llama", "lora", "lora", "auto")]


def loss_and_grads(arch, variant, method, passes, checkpointing):
    model = perturb_adapters(BituneModel.wrap(tiny_model(arch), BituneConfig(variant=variant, method=method),
                                              prompt_passes=passes)).train()
    if checkpointing:
        model.enable_checkpointing()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = model(*batch(prompt_lens=(7, 3, 5), answer_lens=(2, 5, 3)))
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.trainable_parameters().items()}
    return out.loss.detach(), grads, sum(saved)


@pytest.mark.parametrize("arch, variant, method, passes", CASES)
def test_checkpointing_keeps_loss_and_gradients(arch, variant, method, passes):
    loss, grads, saved = loss_and_grads(arch, variant, method, passes, checkpointing=False)
    loss_ckpt, grads_ckpt, saved_ckpt = loss_and_grads(arch, variant, method, passes, checkpointing=True)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=1e-6)
    assert grads_ckpt.keys() == grads.keys() and grads
    for k in grads:
        torch.testing.assert_close(grads_ckpt[k], grads[k], rtol=0, atol=1e-5, msg=k)
    assert saved_ckpt < saved  # the layers' activations are recomputed, not kept


def test_checkpointed_prefill_and_generation_unchanged():
    """Outside autograd (generation, evaluation) a checkpointed model runs its layers as before."""
    model = BituneModel.wrap(tiny_model(), BituneConfig()).eval()
    prompt_ids, prompt_mask, _, _ = batch()
    expected = model.generate(prompt_ids, prompt_mask, max_new_tokens=4)
    model.enable_checkpointing()
    torch.testing.assert_close(model.generate(prompt_ids, prompt_mask, max_new_tokens=4), expected)


def test_transformers_checkpointing_is_still_refused():
    """transformers' own checkpointing drops the prompt cache: refused, naming the setting that keeps it."""
    model = BituneModel.wrap(tiny_model(), BituneConfig()).train()
    model.weights.base.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient_checkpointing: true"):
        model(*batch())


def test_model_without_decoder_layers_is_refused():
    model = BituneModel.wrap(tiny_model(), BituneConfig())
    model.weights.base._no_split_modules = None  # the model names no decoder layer class
    with pytest.raises(BituneError, match="no list of 2 decoder layers"):
        model.enable_checkpointing()
