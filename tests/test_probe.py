"""Wrap's checks (bitune.probe) measure and report; the model decides its paths and notes from what they find."""

from __future__ import annotations

import logging

import pytest
import torch

import bitune.probe as probe
from bitune import BituneConfig, BituneModel
from helpers.models import batch, perturb_adapters, tiny_bitune, tiny_model


def _state(model: BituneModel) -> dict:
    """What the checks could change: the runtime choice, the paths' findings, routing, which weights train."""
    return {"prompt_passes": model.prompt_passes, "support": vars(model.support).copy(),
            "route_ok": model.weights.route_ok, "merged": model.merged,
            "trainable": {k: p.requires_grad for k, p in model.weight_tensors().items()}}


@pytest.mark.parametrize("agree", [True, False])
def test_the_checks_change_nothing_of_the_model_they_check(monkeypatch, agree):
    """Whether the fast paths agree or not, check_wrapped returns its findings and leaves the model as it was."""
    model = perturb_adapters(tiny_bitune("llama", prompt_passes="fused"))
    before = _state(model)
    monkeypatch.setattr(probe, "agree", lambda a, b: agree)
    found = probe.check_wrapped(model)
    assert _state(model) == before
    assert set(found.problems) == (set() if agree else {"batched", "fused"})
    assert found.unreached == []  # wrap froze them: every bidir weight that trains now gets a gradient
    probe.moved(probe.probe_logits(model), probe.probe_logits(model))
    assert _state(model) == before


def test_wrap_freezes_the_bidir_weights_the_checks_find_unreached(monkeypatch):
    """Only the prompt passes' keys and values reach the answer: the last layer's bidir q, o and MLP never train."""
    check, seen = probe.check_wrapped, []
    monkeypatch.setattr(probe, "check_wrapped", lambda model: seen.append(check(model)) or seen[-1])
    model = tiny_bitune("llama")
    unreached = seen[0].unreached
    assert {k for k, p in model.weights.parameters_of("bidir").items() if not p.requires_grad} == set(unreached)
    assert any("layers.1.mlp." in k for k in unreached) and not any("layers.0." in k for k in unreached)


def test_the_model_turns_a_batched_forward_that_disagrees_into_passes_one_by_one(monkeypatch, caplog):
    found = probe.Findings(problems={"batched": "fails (X)", "fused": "fails (Y)"})
    monkeypatch.setattr(probe, "check_wrapped", lambda model: found)
    with caplog.at_level(logging.WARNING, logger="bitune"):
        model = BituneModel.wrap(tiny_model("llama"), BituneConfig())
    note = "the prompt passes batched as one forward fails (X); it runs the prompt passes one by one"
    assert model.support.note == note and [r.getMessage() for r in caplog.records] == [f"LlamaForCausalLM: {note}"]
    assert not model.weights.route_ok and (model.forward_path(), model.prefill_path()) == ("sequential", "sequential")


def test_the_model_turns_a_fused_forward_that_disagrees_into_the_batched_one(monkeypatch, caplog):
    monkeypatch.setattr(probe, "check_wrapped", lambda model: probe.Findings(problems={"fused": "fails (Y)"}))
    with caplog.at_level(logging.WARNING, logger="bitune"):
        model = BituneModel.wrap(tiny_model("llama"), BituneConfig())
    assert model.support.note == "the fused forward fails (Y); it runs the prompt passes batched"
    assert len(caplog.records) == 1 and not model.support.fused and model.weights.route_ok
    assert (model.forward_path(), model.prefill_path()) == ("batched", "batched")


def test_a_merge_that_moves_the_logits_is_undone_and_said(monkeypatch, caplog):
    model = perturb_adapters(tiny_bitune("llama"))
    tensors = batch()
    want = model(*tensors).logits
    monkeypatch.setattr(probe, "moved", lambda after, before: 0.5)
    with caplog.at_level(logging.WARNING, logger="bitune"):
        assert model.merge() is model
    note = "merge() declined: PEFT's merge of this model's adapted layers moves its logits by 0.5; it runs unmerged"
    assert not model.merged and not model.support.merge and model.support.note == note and len(caplog.records) == 1
    torch.testing.assert_close(model(*tensors).logits, want, atol=1e-5, rtol=0)  # unmerge: within rounding


def test_using_runs_a_path_within_its_block_and_puts_the_choice_back():
    model = tiny_bitune("llama", prompt_passes="sequential")
    with pytest.raises(RuntimeError), model.using("fused"):
        assert model.forward_path() == "fused"
        raise RuntimeError
    assert model.prompt_passes == "sequential"
    with pytest.raises(ValueError, match="not one of"), model.using("fast"):
        pass
    assert model.prompt_passes == "sequential"
