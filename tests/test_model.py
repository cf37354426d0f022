"""Properties of the core Bitune model that users rely on."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from peft import PeftModel

from bitune import BituneConfig, BituneModel
from bitune.cache import layer_kv
from bitune.methods import peft_quiet
from helpers.models import PAD, batch, perturb_adapters, row, tiny_bitune, tiny_model

ARCHS = ["llama", "gemma3", "qwen2", "mistral", "phi"]
TWO_PASS = ["bitune", "naive_bidir", "no_mixing", "only_causal", "shared_weights", "anti_causal"]
ALL_VARIANTS = TWO_PASS + ["lora", "pretrained"]


def wrap(arch="llama", variant="bitune", method="lora", perturb=True, **kw):
    model = tiny_bitune(arch, variant=variant, method=method, **kw)
    return perturb_adapters(model) if perturb and variant != "pretrained" else model


def causal_reference(model: BituneModel, tensors, i: int):
    """Plain causal forward of the causal weights over prompt + answer of example i (no padding)."""
    p_ids, _, a_ids, _ = row(tensors, i)
    ids = torch.cat([p_ids, a_ids], 1)
    logits = model.weights.call("causal", input_ids=ids).logits
    return logits[:, p_ids.shape[1] - 1:-1]  # (1, A, V)


@pytest.mark.parametrize("arch", ARCHS)
def test_zero_mixing_equals_plain_causal_forward(arch):
    model = wrap(arch)
    with torch.no_grad():
        model.mixer.theta_k.zero_()
        model.mixer.theta_v.zero_()
    assert model.mixing_ratios()["k"].abs().max() == 0
    tensors = batch()
    out = model(*tensors)
    for i in range(len(tensors[0])):
        ref = causal_reference(model, tensors, i)
        A = ref.shape[1]
        torch.testing.assert_close(out.logits[i:i + 1, :A], ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lora_variant_equals_plain_peft(arch):
    model = wrap(arch, "lora")
    assert isinstance(model.weights.model, PeftModel)
    tensors = batch()
    out = model(*tensors)
    for i in range(len(tensors[0])):
        ref = causal_reference(model, tensors, i)
        torch.testing.assert_close(out.logits[i:i + 1, :ref.shape[1]], ref, atol=1e-5, rtol=0)
    # and the single-pass baseline equals the two-step prefill/answer path
    two_step = model.answer_logits(model.prefill(*tensors[:2]), *tensors[2:])
    torch.testing.assert_close(out.logits, two_step, atol=1e-5, rtol=0)


def _keys_after_change(model, position: int):
    p_ids, p_mask = torch.randint(3, 60, (1, 7)), torch.ones(1, 7, dtype=torch.long)
    changed = p_ids.clone()
    changed[0, position] = (changed[0, position] + 1) % 60 + 3
    L = model.num_layers - 1
    before = [layer_kv(c, L)[0] for c in model.prompt_caches(p_ids, p_mask)]
    after = [layer_kv(c, L)[0] for c in model.prompt_caches(changed, p_mask)]
    return before, after


def test_bidirectional_pass_sees_the_future_and_causal_does_not():
    model = wrap("llama")
    before, after = _keys_after_change(model, position=-2)  # last token the prompt passes read
    causal_0 = (before[0][..., 0, :] - after[0][..., 0, :]).abs().max()
    bidir_0 = (before[1][..., 0, :] - after[1][..., 0, :]).abs().max()
    assert causal_0 == 0
    assert bidir_0 > 1e-4


def test_anti_causal_is_the_mirror_image():
    model = wrap("llama", "anti_causal")
    before, after = _keys_after_change(model, position=0)
    last = -1
    assert (before[1][..., last, :] - after[1][..., last, :]).abs().max() == 0  # anti-causal: no past
    assert (before[0][..., last, :] - after[0][..., last, :]).abs().max() > 1e-4  # causal: sees the past
    before, after = _keys_after_change(model, position=-2)
    assert (before[1][..., 0, :] - after[1][..., 0, :]).abs().max() > 1e-4  # anti-causal: sees the future


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2"])
@pytest.mark.parametrize("variant", ["bitune", "anti_causal", "lora"])
def test_left_padded_batch_equals_one_by_one(arch, variant):
    model = wrap(arch, variant)
    tensors = batch(prompt_lens=(7, 3, 5), answer_lens=(2, 5, 3))
    out = model(*tensors)
    gen = model.generate(*tensors[:2], max_new_tokens=6, eos_token_id=None, pad_token_id=PAD)
    for i in range(3):
        single = row(tensors, i)
        torch.testing.assert_close(out.example_loss[i], model(*single).example_loss[0], atol=1e-5, rtol=0)
        assert torch.equal(gen[i], model.generate(*single[:2], max_new_tokens=6, eos_token_id=None,
                                                  pad_token_id=PAD)[0])


@pytest.mark.parametrize("variant", ["bitune", "shared_weights", "pretrained"])
def test_greedy_generation_is_argmax_of_teacher_forcing(variant):
    model = wrap("llama", variant)
    p_ids, p_mask, _, _ = batch(prompt_lens=(6, 3))
    gen = model.generate(p_ids, p_mask, max_new_tokens=8, eos_token_id=None, pad_token_id=PAD)
    out = model(p_ids, p_mask, gen, torch.ones_like(gen))
    assert torch.equal(out.logits.argmax(-1), gen)


def test_generation_stops_on_eos_and_stop_strings():
    model = wrap("llama")
    p_ids, p_mask, _, _ = batch(prompt_lens=(6, 3))
    free = model.generate(p_ids, p_mask, max_new_tokens=8, eos_token_id=None, pad_token_id=PAD)
    stop_token = int(free[0, 2])
    stopped = model.generate(p_ids, p_mask, max_new_tokens=8, eos_token_id=stop_token, pad_token_id=PAD)
    first = (free[0] == stop_token).nonzero()[0, 0]
    assert torch.equal(stopped[0, :first + 1], free[0, :first + 1])
    assert (stopped[0, first + 1:] == PAD).all()


def _grads(model, tensors):
    model.zero_grad(set_to_none=True)
    model(*tensors).loss.backward()
    return {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}


def test_backward_reaches_both_adapters_and_every_theta_and_a_step_changes_them():
    model = wrap("llama")
    params = model.trainable_parameters()
    model.zero_grad(set_to_none=True)
    model(*batch()).loss.backward()
    for set_name in ("causal", "bidir"):
        grads = [p.grad for k, p in params.items() if k.startswith(set_name)]
        assert grads and all(g is not None and g.abs().sum() > 0 for g in grads), set_name
    assert (model.mixer.theta_k.grad != 0).all() and (model.mixer.theta_v.grad != 0).all()
    before = {k: p.detach().clone() for k, p in params.items()}
    torch.optim.AdamW(params.values(), lr=1e-3).step()
    assert all(not torch.equal(before[k], p) for k, p in params.items())


EXPECTED_SETS = {
    "bitune": {"causal", "bidir", "mixer"}, "only_causal": {"causal", "bidir", "mixer"},
    "anti_causal": {"causal", "bidir", "mixer"}, "no_mixing": {"causal", "bidir"},
    "naive_bidir": {"causal"}, "shared_weights": {"causal", "mixer"}, "lora": {"causal"}, "pretrained": set(),
}


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_each_variant_trains_exactly_its_parameters(variant):
    model = wrap("llama", variant)
    params = model.trainable_parameters()
    assert {k.split(":")[0] for k in params} == EXPECTED_SETS[variant]
    by_id = {id(p): k for k, p in params.items()}
    requires = {id(p) for p in model.parameters() if p.requires_grad}
    assert requires == set(by_id), "requires_grad must be exactly the declared trainable set"
    model.zero_grad(set_to_none=True)
    model(*batch()).loss.backward() if params else None
    got = {id(p) for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert got == set(by_id), sorted(by_id[i] for i in set(by_id) - got)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "mistral", "phi"])
@pytest.mark.parametrize("method", ["lora", "dora", "ia3", "full"])
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_every_variant_method_and_architecture_runs(arch, method, variant):
    if variant == "pretrained" and method != "lora":
        pytest.skip("pretrained trains nothing")
    model = wrap(arch, variant, method)
    tensors = batch()
    out = model(*tensors)
    assert torch.isfinite(out.loss)
    if model.trainable_parameters():
        out.loss.backward()
        assert any(p.grad is not None for p in model.trainable_parameters().values())
    gen = model.generate(*tensors[:2], max_new_tokens=3, pad_token_id=PAD)
    assert gen.shape[0] == 3 and 1 <= gen.shape[1] <= 3


@pytest.mark.parametrize("method", ["lora", "ia3", "full"])
def test_save_load_round_trip(tmp_path, method):
    model = wrap("llama", "bitune", method)
    tensors = batch()
    model.save_pretrained(tmp_path / "ckpt")
    files = {str(p.relative_to(tmp_path / "ckpt")) for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    expected = {"bitune_config.json", "mixer.safetensors", "README.md"}  # README.md: the model card
    if method == "full":
        expected |= {"causal/config.json", "causal/generation_config.json", "causal/model.safetensors",
                     "bidir/model.safetensors"}
    else:
        expected |= {f"{s}/{f}" for s in ("causal", "bidir") for f in ("adapter_config.json",
                                                                       "adapter_model.safetensors")}
    assert files == expected
    assert not any(p.suffix in (".bin", ".pt", ".pkl") for p in (tmp_path / "ckpt").rglob("*"))
    loaded = BituneModel.from_pretrained(tmp_path / "ckpt", base=tiny_model("llama"), merge=False)
    assert torch.equal(model(*tensors).example_loss, loaded(*tensors).example_loss)


def test_prompt_passes_is_a_runtime_argument_not_saved_state(tmp_path):
    model = wrap("llama", "bitune")
    model.save_pretrained(tmp_path / "ckpt")
    config_file = tmp_path / "ckpt" / "bitune_config.json"
    assert "prompt_passes" not in json.loads(config_file.read_text())
    loaded = BituneModel.from_pretrained(tmp_path / "ckpt", base=tiny_model("llama"), prompt_passes="sequential")
    assert loaded.prompt_passes == "sequential" and loaded.forward_path() == "sequential"
    old = {**json.loads(config_file.read_text()), "prompt_passes": "batched"}  # written before it was an argument
    config_file.write_text(json.dumps(old))
    loaded = BituneModel.from_pretrained(tmp_path / "ckpt", base=tiny_model("llama"))
    assert loaded.config == model.config and loaded.prompt_passes == "auto"
    tensors = batch()
    torch.testing.assert_close(loaded(*tensors).loss, model(*tensors).loss, atol=1e-6, rtol=0)


def test_causal_adapter_loads_in_plain_peft(tmp_path):
    model = wrap("llama", "bitune")
    model.save_pretrained(tmp_path / "ckpt")
    with peft_quiet():  # PEFT reads a property transformers 5 deprecated, as when Bitune adds its adapters
        plain = PeftModel.from_pretrained(tiny_model("llama"), str(tmp_path / "ckpt" / "causal"))
    ids = torch.randint(3, 60, (1, 9))
    torch.testing.assert_close(plain(input_ids=ids).logits, model.weights.call("causal", input_ids=ids).logits)


def test_saving_over_a_checkpoint_is_atomic(tmp_path, monkeypatch):
    model = wrap("llama")
    model.save_pretrained(tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "mixer.safetensors").read_bytes()
    with torch.no_grad():
        model.mixer.theta_k.add_(1.0)
    monkeypatch.setattr(type(model.weights.model), "save_pretrained", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "mixer.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("share", [None, 0.5])
def test_mixing_ratio_starts_at_the_start_share_whatever_theta_init(share):
    """Near causal (0.1) by default, one half (the paper's start) when asked."""
    model = tiny_bitune(theta_init=0.001, **({} if share is None else {"init_share": share}))
    ratios = model.mixing_ratios()
    expected = torch.full((2,), 0.1 if share is None else 0.5)
    assert torch.allclose(ratios["k"], expected) and torch.allclose(ratios["v"], expected)


def test_mixing_runs_in_float32_for_bfloat16_models():
    model = tiny_bitune(dtype=torch.bfloat16)
    assert model.mixer.theta_k.dtype == torch.float32
    k_c, k_b = torch.randn(2, 2, 5, 8).bfloat16(), torch.randn(2, 2, 5, 8).bfloat16()
    with torch.no_grad():
        model.mixer.theta_k.fill_(0.0123)
    k, _ = model.mixer(0, k_c, k_b, k_c, k_b)
    a = model.mixer.ratio(model.mixer.theta_k[0])
    assert k.dtype == torch.bfloat16
    assert torch.equal(k, (k_c.float() * (1 - a) + k_b.float() * a).bfloat16())
    assert not torch.equal(k, k_c * (1 - a.bfloat16()) + k_b * a.bfloat16())  # bf16 arithmetic would differ
    out = model(*batch())
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.mixer.theta_k.grad.dtype == torch.float32


# ------------------------------------------------------------------------------------------------ bad input
def test_bad_inputs_raise_value_errors_naming_the_problem():
    model = wrap("llama")
    p_ids, p_mask, a_ids, a_mask = batch()
    with pytest.raises(ValueError, match="at least 2"):
        model(p_ids[:, -1:], p_mask[:, -1:], a_ids, a_mask)
    with pytest.raises(ValueError, match="left-padded"):
        model(p_ids.flip(1), p_mask.flip(1), a_ids, a_mask)
    with pytest.raises(ValueError, match="right-padded|at least one"):
        model(p_ids, p_mask, a_ids.flip(1), a_mask.flip(1))
    with pytest.raises(ValueError, match="batch sizes differ"):
        model(p_ids, p_mask, a_ids[:2], a_mask[:2])
    with pytest.raises(ValueError, match="prompt_mask"):
        model(p_ids, p_mask[:, 1:], a_ids, a_mask)
    with pytest.raises(ValueError, match="at least one real token"):
        model(p_ids, p_mask, a_ids[:, :0], a_mask[:, :0])
    one_token = p_mask.clone()
    one_token[1, :-1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        model(p_ids, one_token, a_ids, a_mask)
    with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 64\)"):
        model(p_ids, p_mask, a_ids + 64, a_mask)
    with pytest.raises(ValueError, match="token ids"):
        model.generate(p_ids - 100, p_mask)


@pytest.mark.filterwarnings("ignore:_compile flag on create_block_mask:DeprecationWarning")  # transformers' flex mask
def test_bad_configs_and_architectures_are_rejected():
    with pytest.raises(ValueError, match="variant"):
        BituneConfig(variant="bidirectional")
    with pytest.raises(ValueError, match="method"):
        BituneConfig(method="qlora")
    with pytest.raises(ValueError, match="theta_init"):
        BituneConfig(theta_init=0)
    with pytest.raises(ValueError, match="unknown key"):
        BituneConfig.from_dict({"varient": "bitune"})
    with pytest.raises(ValueError, match="not a transformers causal LM"):
        BituneModel.wrap(torch.nn.Linear(2, 2))
    peft_model = wrap("llama").weights.model
    with pytest.raises(ValueError, match="PeftModel"):
        BituneModel.wrap(peft_model)
    with pytest.raises(ValueError, match="'flex_attention' is not supported"):
        BituneModel.wrap(tiny_model("llama", attn="flex_attention"))
    with pytest.raises(ValueError, match="prompt_passes='parallel' is not one of"):
        BituneModel.wrap(tiny_model("llama"), prompt_passes="parallel")
    with pytest.raises(ValueError, match="unknown key.*prompt_passes"):  # no longer a model setting
        BituneConfig.from_dict({"prompt_passes": "fused"})


def test_incompatible_or_corrupt_checkpoints_are_rejected(tmp_path):
    model = wrap("llama")
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError):
        BituneModel.from_pretrained(tmp_path / "ckpt", base=_wider_llama())
    (tmp_path / "ckpt" / "mixer.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt"):
        BituneModel.from_pretrained(tmp_path / "ckpt", base=tiny_model("llama"))
    with pytest.raises(ValueError, match="not a Bitune checkpoint"):
        BituneModel.from_pretrained(tmp_path, base=tiny_model("llama"))


def test_a_checkpoint_whose_config_and_weights_disagree_or_hold_nan_is_rejected(tmp_path):
    from safetensors.torch import load_file, save_file

    model = wrap("llama")
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    BituneModel.from_pretrained(ckpt, base=tiny_model("llama"))  # as saved: loads
    config = json.loads((ckpt / "bitune_config.json").read_text())
    for variant, stray in (("lora", "mixer.safetensors, bidir/"), ("pretrained", "mixer.safetensors, causal/, bidir/"),
                           ("naive_bidir", "mixer.safetensors, bidir/")):
        edited = tmp_path / variant
        shutil.copytree(ckpt, edited)
        (edited / "bitune_config.json").write_text(json.dumps({**config, "variant": variant}))
        with pytest.raises(ValueError, match=f"holds {stray}, which its config \\(variant '{variant}'\\)"):
            BituneModel.from_pretrained(edited, base=tiny_model("llama"))
    for part in ("mixer.safetensors", "bidir/adapter_model.safetensors"):
        broken = tmp_path / f"nan-{part.split('/')[0]}"
        shutil.copytree(ckpt, broken)
        state = load_file(str(broken / part))
        next(iter(state.values())).view(-1)[0] = float("nan")
        save_file(state, str(broken / part))
        with pytest.raises(ValueError, match="holds NaN or infinite values"):
            BituneModel.from_pretrained(broken, base=tiny_model("llama"))


def _wider_llama():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from helpers.models import COMMON
    cfg = LlamaConfig(**{**COMMON, "hidden_size": 48, "num_key_value_heads": 2})
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("variant", ["bitune", "anti_causal"])
def test_eager_and_sdpa_attention_give_the_same_losses(arch, variant):
    losses = []
    for attn in ("sdpa", "eager"):
        model = tiny_bitune(arch, attn=attn, variant=variant)
        losses.append(perturb_adapters(model)(*batch()).example_loss)
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=0)
