"""LoRA routing: one forward with an adapter per row or per position computes what PEFT computes running each
adapter separately on its rows or positions (outputs and gradients), and leaves PEFT's own state untouched."""

from __future__ import annotations

import pytest
import torch

from bitune.adapters import Routing, routed, routed_lora_forward
from helpers.models import VOCAB, perturb_adapters, tiny_bitune


def _model(method="lora"):
    return perturb_adapters(tiny_bitune(method=method), scale=0.3)


def _adapter_params(layer):
    return [layer.lora_A[n].weight for n in ("causal", "bidir")] + [layer.lora_B[n].weight for n in ("causal", "bidir")]


def _peft_forward(model, layer, x, name):
    """The layer's own PEFT forward with adapter ``name`` active (PEFT's public set_adapter)."""
    model.weights.model.set_adapter(name)
    try:
        return layer(x)
    finally:
        model.weights.model.set_adapter("causal")
        model.weights.model.set_requires_grad(["causal", "bidir"], True)


def _outputs_and_grads(out, x, params, weight):
    loss = (out * weight).sum()
    return out.detach(), torch.autograd.grad(loss, [x, *params])


@pytest.mark.parametrize("dim", [0, 1])
def test_routed_layer_equals_each_adapter_run_separately(dim):
    model = _model()
    layer = model.weights._lora_layers[0]
    torch.manual_seed(0)
    x = torch.randn(3, 5, layer.in_features, requires_grad=True)  # (B, T, d_in)
    blocks = [("causal", 1), ("bidir", 1), ("causal", 1)] if dim == 0 else [("bidir", 2), ("causal", 3)]
    out = routed_lora_forward(layer, x, Routing(blocks, dim))  # (B, T, d_out)
    weight = torch.randn(out.shape)
    got = _outputs_and_grads(out, x, _adapter_params(layer), weight)

    parts, start = [], 0
    for name, size in blocks:  # PEFT itself, one adapter at a time, on that adapter's rows or positions
        parts.append(_peft_forward(model, layer, x.narrow(dim, start, size), name))
        start += size
    expected = _outputs_and_grads(torch.cat(parts, dim), x, _adapter_params(layer), weight)
    torch.testing.assert_close(got[0], expected[0], atol=1e-6, rtol=1e-5)
    for g, e in zip(got[1], expected[1]):
        assert g.abs().sum() > 0  # every adapter and the input get a gradient
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)


def test_one_adapter_is_exactly_peft():
    model = _model()
    layer = model.weights._lora_layers[3]
    x = torch.randn(2, 4, layer.in_features)
    for name in ("causal", "bidir"):
        assert torch.equal(routed_lora_forward(layer, x, Routing([(name, 2)])), _peft_forward(model, layer, x, name))


def test_call_rows_equals_each_weight_set_on_its_rows():
    model = _model()
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    names = ["bidir", "causal", "bidir"]
    routed_logits = model.weights.call_rows(names, input_ids=ids).logits  # (3, 6, V)
    for r, name in enumerate(names):
        alone = model.weights.call(name, input_ids=ids[r:r + 1]).logits
        torch.testing.assert_close(routed_logits[r:r + 1], alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(routed_logits[0], routed_logits[1])  # the two sets differ


def test_routing_leaves_peft_state_untouched_even_after_an_error():
    model = _model()
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    ids = torch.randint(3, VOCAB, (2, 5))
    model.weights.call_segments([("bidir", 2), ("causal", 3)], input_ids=ids)
    model.weights.call("bidir", input_ids=ids)
    with pytest.raises(RuntimeError, match="boom"):
        with routed(model.weights._lora_layers, Routing([("bidir", 2)])):
            raise RuntimeError("boom")
    for layer in model.weights._lora_layers:
        assert "forward" not in vars(layer) and layer.active_adapters == ["causal"]
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags


@pytest.mark.parametrize("method", ["dora", "ia3"])
def test_unroutable_methods_switch_adapters_without_changing_what_trains(method):
    model = _model(method)
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    ids = torch.randint(3, VOCAB, (2, 5))
    causal = model.weights.call("causal", input_ids=ids).logits
    bidir = model.weights.call("bidir", input_ids=ids).logits
    assert not torch.allclose(causal, bidir)
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags
    assert torch.equal(model.weights.call("causal", input_ids=ids).logits, causal)
    with pytest.raises(ValueError, match="cannot mix weight sets"):
        model.weights.call_rows(["causal", "bidir"], input_ids=ids)
