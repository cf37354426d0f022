"""The batched two-pass forward computes exactly what two sequential prompt passes compute."""

from __future__ import annotations

import pytest
import torch

from bitune import BituneConfig, BituneModel
from conftest import PAD, batch, perturb_adapters, tiny_model

TWO_PASS = ["bitune", "only_causal", "shared_weights", "anti_causal"]


def _pair(arch, variant, method="lora"):
    models = []
    for mode in ("sequential", "batched"):
        cfg = BituneConfig(variant=variant, method=method, prompt_passes=mode)
        models.append(perturb_adapters(BituneModel.wrap(tiny_model(arch), cfg)))
    return models


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("variant", TWO_PASS)
def test_batched_equals_sequential(arch, variant):
    seq, bat = _pair(arch, variant)
    tensors = batch(prompt_lens=(7, 3, 5), answer_lens=(2, 5, 3))
    calls = []
    handle = bat.weights.base.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape),
                                                       with_kwargs=True)
    out_b = bat(*tensors)
    handle.remove()
    assert calls[0][0] == 6, "the two prompt passes must run as one forward over 2B rows"
    out_s = seq(*tensors)
    torch.testing.assert_close(out_b.loss, out_s.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(out_b.logits, out_s.logits, atol=1e-5, rtol=0)
    out_b.loss.backward()
    out_s.loss.backward()
    grads_s = {k: p.grad for k, p in seq.trainable_parameters().items()}
    for k, p in bat.trainable_parameters().items():
        torch.testing.assert_close(p.grad, grads_s[k], atol=1e-5, rtol=1e-4, msg=k)
    gen = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=PAD)
    assert torch.equal(bat.generate(*tensors[:2], **gen), seq.generate(*tensors[:2], **gen))


def test_methods_that_cannot_route_rows_fall_back_to_sequential():
    _, bat = _pair("llama", "bitune", method="ia3")
    calls = []
    bat.weights.base.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape[0]),
                                               with_kwargs=True)
    bat(*batch())
    assert calls[:2] == [3, 3]
