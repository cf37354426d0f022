"""The fused and batched forwards compute exactly what sequential prompt passes and answer pass compute."""

from __future__ import annotations

import pytest
import torch

from bitune import BituneConfig
from bitune.config import PAPER_INIT_SHARE
from helpers.models import PAD, batch, perturb_adapters, tiny_bitune, tiny_model

TWO_PASS = ["bitune", "only_causal", "shared_weights", "anti_causal"]
ONE_PASS = ["naive_bidir", "no_mixing"]


def _pair(arch, variant, method="lora", mode="batched", attn="sdpa"):
    models = []
    for m in ("sequential", mode):
        models.append(perturb_adapters(tiny_bitune(arch, attn=attn, prompt_passes=m, variant=variant, method=method)))
    return models


def _assert_same_loss_logits_grads(fast, seq, tensors):
    out_f, out_s = fast(*tensors), seq(*tensors)
    real = tensors[3].bool()  # logits at answer padding are never used
    torch.testing.assert_close(out_f.loss, out_s.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(out_f.logits[real], out_s.logits[real], atol=1e-5, rtol=0)
    out_f.loss.backward()
    out_s.loss.backward()
    grads_s = {k: p.grad for k, p in seq.trainable_parameters().items()}
    for k, p in fast.trainable_parameters().items():
        assert (p.grad is None) == (grads_s[k] is None), k
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads_s[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("gemma3", "sdpa"), ("gemma3", "eager"), ("qwen2", "eager"),
                                       ("mistral", "sdpa"), ("phi", "sdpa")])
@pytest.mark.parametrize("variant", TWO_PASS + ONE_PASS)
def test_fused_forward_equals_sequential(arch, attn, variant):
    seq, fused = _pair(arch, variant, mode="fused", attn=attn)
    assert fused.forward_path() == "fused" and seq.forward_path() == "sequential"
    tensors = batch(prompt_lens=(7, 3, 5), answer_lens=(2, 5, 3))  # gemma3's window (4) < its prompts
    calls = []
    fused.weights.base.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["input_ids"].shape),
                                                 with_kwargs=True)
    _assert_same_loss_logits_grads(fused, seq, tensors)
    passes = len(fused.config.passes)
    assert calls == [(3, passes * 6 + 5)], "prompt passes and answer pass must run as one forward"
    assert fused.weights.base.config._attn_implementation == attn  # the model's own attention is back


def test_fused_forward_restores_the_attention_implementation_after_an_error(monkeypatch):
    model = tiny_bitune()
    loss = model(*batch()).loss
    with monkeypatch.context() as m:
        m.setattr(model.mixer, "forward", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            model(*batch())
    assert model.weights.base.config._attn_implementation == "sdpa"
    torch.testing.assert_close(model(*batch()).loss, loss, atol=0, rtol=0)  # and it still works


def test_auto_fuses_training_and_falls_back_where_weights_cannot_be_routed():
    model = tiny_bitune()  # LoRA, the default
    assert (model.forward_path(), model.prefill_path()) == ("fused", "batched")
    for method in ("ia3", "dora", "full"):
        model = tiny_bitune(method=method)
        assert (model.forward_path(), model.prefill_path()) == ("sequential", "sequential"), method
    shared = tiny_bitune(variant="shared_weights", method="ia3")
    assert shared.forward_path() == "fused"
    assert tiny_bitune(variant="lora").forward_path() == "single"
    model = tiny_bitune(prompt_passes="batched")
    assert (model.forward_path(), model.prefill_path()) == ("batched", "batched")
    model.prompt_passes = "sequential"  # a runtime choice: it can change on a built model
    assert (model.forward_path(), model.prefill_path()) == ("sequential", "sequential")
    with pytest.raises(ValueError, match="prompt_passes='parallel' is not one of"):
        model.prompt_passes = "parallel"


def test_fused_forward_refuses_gradient_checkpointing():
    model = tiny_bitune().train()
    model.weights.base.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        model(*batch())


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


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fused_equals_sequential_in_bfloat16(arch):
    losses = []
    for mode in ("sequential", "fused"):
        model = tiny_bitune(arch, dtype=torch.bfloat16, prompt_passes=mode)
        losses.append(perturb_adapters(model)(*batch(prompt_lens=(7, 3, 5), answer_lens=(2, 5, 3))).loss.float())
    torch.testing.assert_close(losses[0], losses[1], atol=5e-3, rtol=0)


def test_path_functions_run_on_the_parts_alone():
    """The path functions take what they need (weight sets, passes, mixer, text config), not a BituneModel: built
    from those parts alone, the fused forward == both prompt passes one by one, mixed, then the causal answer pass,
    and the batched prompt read == the one-by-one read."""
    from bitune import cache as kv
    from bitune.adapters import WeightSets
    from bitune.fused import fused_logits
    from bitune.masks import position_ids
    from bitune.mixer import Mixer
    from bitune.passes import read_pass, read_passes_batched
    from bitune.support import check_model

    config = BituneConfig()
    base = tiny_model("gemma3")  # sliding-window layers too
    layers = check_model(base)
    weights, text = WeightSets(base, config), base.config.get_text_config()
    mixer = Mixer(text.num_hidden_layers, config.theta_init, PAPER_INIT_SHARE)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in [p for name in config.weight_sets for p in weights.parameters_of(name).values()] + [
                mixer.theta_k, mixer.theta_v]:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    prompt_ids, prompt_mask, answer_ids, answer_mask = batch()
    with torch.no_grad():
        fused = fused_logits(weights, mixer, config.passes, text, prompt_ids, prompt_mask, answer_ids, answer_mask)
        ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]
        one_by_one = [read_pass(weights, text, layers, ids, mask, w, k) for w, k in config.passes]
        batched = read_passes_batched(weights, text, layers, ids, mask, config.passes)
        for alone, together in zip(one_by_one, batched):
            for layer in range(text.num_hidden_layers):
                for a, b in zip(kv.layer_kv(alone, layer), kv.layer_kv(together, layer)):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        kv.mix_into(one_by_one[0], one_by_one[1], mixer, layers)
        steps = torch.cat([prompt_ids[:, -1:], answer_ids[:, :-1]], dim=1)  # (B, A)
        full = torch.cat([mask, torch.ones_like(mask[:, :1]), answer_mask[:, :-1]], dim=1)
        out = weights.call("causal", input_ids=steps, attention_mask=full, cache=one_by_one[0], use_cache=True,
                           position_ids=position_ids(full)[:, -steps.shape[1]:])
    real = answer_mask.bool()
    torch.testing.assert_close(fused[real], out.logits[real], atol=1e-5, rtol=0)
    assert (fused[real] - weights.call("causal", input_ids=steps).logits[real]).abs().max() > 1e-3  # read the prompt


def test_auto_reads_large_prompt_batches_one_pass_at_a_time_with_the_same_numbers(monkeypatch):
    """``auto`` batches the two prompt passes up to BATCHED_PREFILL_MAX_POSITIONS positions per pass and reads
    larger batches one pass at a time (faster there); an explicit ``batched`` stays batched; the numbers agree."""
    import bitune.model
    import bitune.passes

    limit = bitune.model.BATCHED_PREFILL_MAX_POSITIONS
    model = perturb_adapters(tiny_bitune())
    assert [model.prefill_path(n) for n in (None, limit, limit + 1)] == ["batched", "batched", "sequential"]
    model.prompt_passes = "batched"
    assert model.prefill_path(limit + 1) == "batched"
    model.prompt_passes = "auto"
    ids, mask = batch()[:2]  # 3 prompts of up to 6 tokens: 15 positions per pass
    reads = []
    monkeypatch.setattr(bitune.model, "read_passes_batched",
                        lambda *a, **k: reads.append("batched") or bitune.passes.read_passes_batched(*a, **k))
    monkeypatch.setattr(bitune.model, "BATCHED_PREFILL_MAX_POSITIONS", 15)
    batched = model.prefill(ids, mask)
    monkeypatch.setattr(bitune.model, "BATCHED_PREFILL_MAX_POSITIONS", 14)
    sequential = model.prefill(ids, mask)
    assert reads == ["batched"]
    from bitune import cache as kv

    real = mask[:, :-1].bool()  # (B, P-1): the positions read (padding rows of the cache may differ)
    for layer in range(kv.num_layers(batched.cache)):
        (kb, vb), (ks, vs) = kv.layer_kv(batched.cache, layer), kv.layer_kv(sequential.cache, layer)  # (B, H, T, D)
        torch.testing.assert_close(kb.transpose(1, 2)[real], ks.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vb.transpose(1, 2)[real], vs.transpose(1, 2)[real], atol=1e-5, rtol=1e-5)
