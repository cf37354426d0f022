"""Activation checkpointing per decoder layer (``recompute: true``): the prompt caches are kept and
nothing is written into them twice, so loss and gradients equal the run without it, on every path (fused,
batched, sequential), for every method, with sliding-window layers (Gemma 3) too, and activations are
recomputed (every layer call runs once more in the backward; fewer tensors saved for it). Without autograd
(generation, evaluation) the checkpointing is off: the layers run once, as without it."""

from __future__ import annotations

import pytest
import torch

from bitune.errors import BituneError
from helpers.compare import assert_same_weights
from helpers.models import batch, perturb_adapters, tiny_bitune

CASES = [("llama", "bitune", "lora", "fused"), ("llama", "bitune", "lora", "batched"),
         ("llama", "bitune", "lora", "sequential"), ("gemma3", "bitune", "lora", "fused"),
         ("gemma3", "bitune", "lora", "sequential"), ("llama", "bitune", "full", "auto"),
         ("llama", "bitune", "dora", "auto"), ("llama", "bitune", "ia3", "auto"),
         ("llama", "no_mixing", "lora", "auto"), ("llama", "lora", "lora", "auto")]


def count_layer_calls(model) -> list[int]:
    """A counter of the decoder layers' runs, kept up to date: one per attention block entered, so a recomputation
    in the backward counts as well (checkpointing stops a recomputation early, once it has what the backward needs:
    a block entered need not return, and a forward hook would miss it)."""
    calls = [0]
    for layer in model.decoder_layers():
        layer.self_attn.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    return calls


def loss_and_grads(arch, variant, method, passes, checkpointing):
    """Loss, gradients, numbers saved for the backward, and the layer runs in the forward and in the backward."""
    model = perturb_adapters(tiny_bitune(arch, variant=variant, method=method, prompt_passes=passes)).train()
    if checkpointing:
        model.enable_recompute()
    calls = count_layer_calls(model)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = model(*batch(prompt_lens=(7, 3, 5), answer_lens=(2, 5, 3)))
    forward_calls = calls[0]
    out.loss.backward()
    grads = {k: p.grad.clone() for k, p in model.trainable_parameters().items()}
    return out.loss.detach(), grads, sum(saved), (forward_calls, calls[0] - forward_calls)


@pytest.mark.parametrize("arch, variant, method, passes", CASES)
def test_checkpointing_keeps_loss_and_gradients(arch, variant, method, passes):
    """With gradients enabled, as in training: the same loss and gradients, and the layers really recomputed."""
    assert torch.is_grad_enabled()
    loss, grads, saved, (forward, backward) = loss_and_grads(arch, variant, method, passes, checkpointing=False)
    loss_ckpt, grads_ckpt, saved_ckpt, (forward_ckpt, backward_ckpt) = loss_and_grads(arch, variant, method, passes,
                                                                                      checkpointing=True)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=1e-6)
    assert grads
    assert_same_weights(grads_ckpt, grads, atol=1e-5)
    assert forward_ckpt == forward > 0 and backward == 0  # the same layer runs in the forward, none in the backward
    assert backward_ckpt == forward  # ... but with checkpointing every layer run is recomputed, once, in the backward
    assert saved_ckpt < saved  # the layers' activations are recomputed, not kept


def test_without_autograd_the_layers_run_as_without_checkpointing(monkeypatch):
    """Generation and evaluation run under ``torch.no_grad()``, where checkpointing has nothing to save: a
    checkpointed model runs each layer once, never through ``torch.utils.checkpoint`` (whose recomputation would
    read a stand-in cache), and writes its caches as before, so it generates the same tokens. (The checkpointing
    itself, with gradients, is tested above.)"""
    import bitune.recompute

    entered = []
    real = bitune.recompute.checkpoint
    monkeypatch.setattr(bitune.recompute, "checkpoint", lambda *a, **k: entered.append(1) or real(*a, **k))
    model = tiny_bitune().eval()
    calls = count_layer_calls(model)
    prompt_ids, prompt_mask, _, _ = batch()
    expected = model.generate(prompt_ids, prompt_mask, max_new_tokens=4)
    plain_calls, calls[0] = calls[0], 0
    model.enable_recompute()
    assert model.recomputing
    torch.testing.assert_close(model.generate(prompt_ids, prompt_mask, max_new_tokens=4), expected)
    assert calls[0] == plain_calls > 0 and not entered
    with torch.enable_grad():  # the same model with autograd on does go through the checkpoint
        model.train()(*batch()).loss.backward()
    assert entered


def test_transformers_checkpointing_is_still_refused():
    """transformers' own checkpointing drops the prompt cache: refused, naming the setting that keeps it."""
    model = tiny_bitune().train()
    model.weights.base.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="recompute: true"):
        model(*batch())


def test_model_without_decoder_layers_is_refused():
    model = tiny_bitune()
    model.weights.base._no_split_modules = None  # the model names no decoder layer class
    with pytest.raises(BituneError, match="no list of 2 decoder layers"):
        model.enable_recompute()
