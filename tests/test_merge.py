"""Merged inference: the causal weights merged into the base weights give the unmerged model's numbers (every
variant and method), decoding runs the base projections alone, and training is untouched by it."""

from __future__ import annotations

import pytest
import torch

from bitune import BituneConfig, BituneModel
from bitune.errors import BituneError
from bitune.export import export_merged
from bitune.scoring import score_continuations
from helpers.models import EOS, batch, perturb_adapters, tiny_bitune, tiny_model

VARIANTS = ["bitune", "lora", "shared_weights", "only_causal", "naive_bidir", "no_mixing", "anti_causal", "pretrained"]


def pair(variant: str = "bitune", method: str = "lora", arch: str = "llama", prompt_passes: str = "auto"):
    """The same trained-looking model twice: unmerged and merged."""
    models = []
    for merge in (False, True):
        config = BituneConfig(variant=variant, method=method, rank=4, lora_alpha=8.0)
        model = tiny_bitune(arch, config, prompt_passes=prompt_passes)
        if variant != "pretrained":
            perturb_adapters(model, scale=0.1)
        models.append(model.merge().eval() if merge else model.eval())
    return models


def prompts():
    ids, mask, answer_ids, answer_mask = batch(3, prompt_lens=(7, 4, 6), answer_lens=(3, 5, 2))
    return ids, mask, answer_ids, answer_mask


@pytest.mark.parametrize("method", ["lora", "dora", "ia3"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_gives_the_unmerged_numbers(variant, method):
    if method != "lora" and variant == "pretrained":
        pytest.skip("nothing to merge")
    plain, merged = pair(variant, method)
    assert merged.merged == (variant != "pretrained")
    ids, mask, answer_ids, answer_mask = prompts()
    with torch.no_grad():
        a = plain.answer_logits(plain.prefill(ids, mask), answer_ids, answer_mask)
        b = merged.answer_logits(merged.prefill(ids, mask), answer_ids, answer_mask)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
        loss_a = plain(ids, mask, answer_ids, answer_mask).example_loss  # the fused path where it applies
        loss_b = merged(ids, mask, answer_ids, answer_mask).example_loss
        torch.testing.assert_close(loss_b, loss_a, atol=1e-4, rtol=0)
    greedy = [m.generate(ids, mask, max_new_tokens=32, eos_token_id=None, pad_token_id=0) for m in (plain, merged)]
    assert torch.equal(greedy[0], greedy[1])


@pytest.mark.parametrize("prompt_passes", ["batched", "sequential", "fused"])
def test_merged_paths_agree(prompt_passes):
    plain, merged = pair("bitune", "lora", prompt_passes=prompt_passes)
    ids, mask, answer_ids, answer_mask = prompts()
    with torch.no_grad():
        a = plain(ids, mask, answer_ids, answer_mask).logits
        b = merged(ids, mask, answer_ids, answer_mask).logits
    torch.testing.assert_close(b, a, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_merged_on_other_architectures(arch):
    plain, merged = pair("bitune", "lora", arch=arch)
    ids, mask, _, _ = prompts()
    greedy = [m.generate(ids, mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0) for m in (plain, merged)]
    assert torch.equal(greedy[0], greedy[1])


def test_merged_scores_and_continued_conversations_match():
    plain, merged = pair()
    ids, mask, _, _ = prompts()
    continuations = [[[5, 6, 7], [8]], [[9, 10]], [[11], [12, 13, 14, EOS]]]
    with torch.no_grad():
        scores = [score_continuations(m.weights, m.text_config, m.prefill(ids, mask), continuations)
                  for m in (plain, merged)]
    for (la, ga), (lb, gb) in zip(*scores):
        assert lb == pytest.approx(la, abs=1e-4) and ga == gb
    states = [m.generate(ids, mask, max_new_tokens=4, eos_token_id=None, pad_token_id=0, return_state=True)[1] for m in (plain, merged)]
    follow, follow_mask = ids[:, -3:], torch.ones_like(ids[:, -3:])
    again = [m.generate(follow, follow_mask, max_new_tokens=8, past=s, eos_token_id=None, pad_token_id=0)
             for m, s in zip((plain, merged), states)]
    assert torch.equal(again[0], again[1])


def _count_calls(module_list):
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in module_list]
    return calls, hooks


def test_decoding_runs_the_base_projections_alone():
    """After merging, the answer pass and decoding never touch an adapter factor; only the bidir prompt pass
    does (the difference to the bidir set)."""
    _, merged = pair()
    factors = [m for name, m in merged.named_modules() if name.endswith(("lora_A.causal", "lora_B.causal"))]
    assert factors
    calls, hooks = _count_calls(factors)
    ids, mask, _, _ = prompts()
    state = merged.prefill(ids, mask)
    assert not calls  # the routed bidir pass reads the factors' weights directly, the causal pass not at all
    with torch.no_grad():
        for _ in range(3):
            state = merged.decode_step(state, lambda logits: logits.argmax(-1))
    for h in hooks:
        h.remove()
    assert not calls


def test_a_merged_layer_calls_its_base_projection_directly(monkeypatch):
    """PEFT's layer forward (checks and bookkeeping around the base projection) runs in no decoding step of a
    merged model, also after a bidir prompt pass routed its layers; unmerged, PEFT's forward is back."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    _, merged = pair()
    calls = []
    peft_forward = LoraLinear.forward
    monkeypatch.setattr(LoraLinear, "forward", lambda self, *a, **k: calls.append(1) or peft_forward(self, *a, **k))
    ids, mask, _, _ = prompts()
    with torch.no_grad():
        state = merged.prefill(ids, mask)
        for _ in range(2):
            state = merged.decode_step(state, lambda logits: logits.argmax(-1))
    assert not calls
    merged.unmerge()
    with torch.no_grad():
        merged.decode_step(merged.prefill(ids, mask), lambda logits: logits.argmax(-1))
    assert calls


def test_a_merged_model_refuses_to_train_and_trains_after_unmerge():
    _, merged = pair()
    ids, mask, answer_ids, answer_mask = prompts()
    merged.train()
    with pytest.raises(BituneError, match="merged for inference"):
        merged(ids, mask, answer_ids, answer_mask)
    merged.unmerge()
    assert not merged.merged
    merged(ids, mask, answer_ids, answer_mask).loss.backward()
    with pytest.raises(BituneError, match="unmerge"):
        merged.merge().load_weights("nowhere")


def test_unmerge_restores_the_weights_to_rounding():
    plain, merged = pair()
    before = {k: v.clone() for k, v in merged.weights.base.state_dict().items()}
    merged.unmerge()
    for k, v in merged.weights.base.state_dict().items():
        torch.testing.assert_close(v, before[k] if "base_layer" not in k else plain.weights.base.state_dict()[k],
                                   atol=1e-6, rtol=0)


def test_dora_bidir_copy_is_put_back_exactly():
    """Merging DoRA keeps one bidir-merged copy per layer and leaves the causal merge as PEFT makes it."""
    plain, merged = pair("bitune", "dora")
    layer = next(m for m in merged.weights.model.modules() if hasattr(m, "merged_adapters") and m.merged_adapters)
    assert layer.merged_adapters == ["causal"]
    assert len(merged.weights.bidir_copies) == sum(
        1 for m in merged.weights.model.modules() if hasattr(m, "merged_adapters"))


@pytest.mark.parametrize("inference", ["generate", "merge_then_unmerge"])
def test_training_after_inference_matches_training_alone(tmp_path, inference):
    """A wrapped model is never merged in place: generating with it before training changes nothing, bit for
    bit. A model merged and unmerged again trains to the same weights within float rounding."""
    from bitune.train.trainer import run_training
    from helpers.compare import trainable
    from helpers.train import make_trainer

    results = []
    for before in (None, inference):
        trainer, settings = make_trainer(tmp_path / str(before), steps=3)
        model = trainer.model
        if before is not None:
            model.eval()
            model.generate(*prompts()[:2], max_new_tokens=4, eos_token_id=None, pad_token_id=0)
            if before == "merge_then_unmerge":
                model.merge()
                model.generate(*prompts()[:2], max_new_tokens=4, eos_token_id=None, pad_token_id=0)
                model.unmerge()
        run_training(trainer, settings)
        results.append(trainable(trainer.model))
    for k, v in results[0].items():
        if inference == "generate":
            assert torch.equal(results[1][k], v), k
        else:
            torch.testing.assert_close(results[1][k], v, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_export_merged_is_a_plain_transformers_model_that_continues_a_prefill(tmp_path, method):
    from transformers import AutoModelForCausalLM

    _, merged = pair("bitune", method)
    ids, mask, _, _ = prompts()
    gen = dict(max_new_tokens=8, eos_token_id=None, pad_token_id=0, do_sample=False)
    expected = merged.generate(ids, mask, **gen)
    export_merged(merged, tmp_path / "export")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert not any("lora" in k or "base_layer" in k for k in plain.state_dict())
    pre = merged.prefill(ids, mask)  # the prefill workers' part: both prompt passes, mixed
    input_ids = torch.cat([pre.ids, pre.last_token], dim=1)
    attention = torch.cat([pre.mask, torch.ones_like(pre.last_token)], dim=1)
    out = plain.generate(input_ids=input_ids, attention_mask=attention, cache=pre.cache, **gen)
    assert torch.equal(out[:, input_ids.shape[1]:], expected)
    again = BituneModel.from_pretrained(tmp_path / "export" / "bitune", base=tiny_model())
    assert torch.equal(again.generate(ids, mask, **gen), expected)
    assert merged.merged  # exporting leaves the model as it was


def test_export_of_an_unmerged_model_leaves_it_unmerged(tmp_path):
    plain, _ = pair()
    export_merged(plain, tmp_path / "export")
    assert not plain.merged


def test_bitune_export_command(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from bitune.cli import main
    from helpers.gen import save_checkpoint

    ckpt, _ = save_checkpoint(tmp_path)
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(tmp_path / "out")]) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out") is not None
    assert (tmp_path / "out" / "bitune" / "bitune_config.json").is_file()
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()
    assert main(["export", "--checkpoint", str(ckpt), "--merged", str(ckpt / "inside")]) == 2
    assert "overlaps --checkpoint" in capsys.readouterr().err


@pytest.mark.integration
def test_merged_smollm2_matches_unmerged():
    """SmolLM2-135M with trained-looking adapters: next-token logits within 1e-4, the same greedy 32 tokens on a
    fixed prompt set (batched, both prompt-pass paths), the same lm-eval multiple-choice scores to 1e-4."""
    from lm_eval.api.instance import Instance

    from bitune.eval.lm import BituneLM
    from bitune.hub import load_model

    models, tokenizer = [], None
    for merge in (False, True):
        base, tokenizer = load_model("smollm2-135m")
        torch.manual_seed(0)  # LoRA A's initialisation: the same adapters in both
        model = perturb_adapters(BituneModel.wrap(base, BituneConfig()), scale=0.02).eval()
        models.append(model.merge() if merge else model)
    tokenizer.padding_side = "left"
    texts = ["Question: What is the capital of France?\n\nAnswer:", "Question: Name a prime number above 10.\n\nAnswer:",
             "Question: Why do leaves change colour in autumn?\n\nAnswer:", "Question: 2 + 3 =\n\nAnswer:"]
    p = tokenizer(texts, return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=32, eos_token_id=None, pad_token_id=tokenizer.pad_token_id, do_sample=False)
    with torch.no_grad():
        pre = [m.prefill(p.input_ids, p.attention_mask) for m in models]
        last = [m.answer_logits(s, s.last_token, torch.ones_like(s.last_token)) for m, s in zip(models, pre)]
    torch.testing.assert_close(last[1], last[0], atol=1e-4, rtol=0)
    for passes in ("batched", "sequential"):
        outs = []
        for m in models:
            m.prompt_passes = passes
            outs.append(m.generate(p.input_ids, p.attention_mask, **gen))
        assert torch.equal(outs[0], outs[1]), passes
    requests = [Instance("loglikelihood", {}, (texts[0], c), i) for i, c in enumerate([" Paris", " London", " Rome"])]
    scores = [BituneLM(model=m, tokenizer=tokenizer, batch_size=2).loglikelihood(requests) for m in models]
    for (la, ga), (lb, gb) in zip(*scores):
        assert lb == pytest.approx(la, abs=1e-4) and ga == gb


@pytest.mark.parametrize("variant", ["bitune", "no_mixing", "anti_causal"])
def test_merging_the_bidir_set_into_a_copy_gives_the_unmerged_numbers(variant):
    plain, merged = pair(variant)
    both = tiny_bitune("llama", BituneConfig(variant=variant, rank=4, lora_alpha=8.0))
    both.load_state_dict(plain.state_dict())
    both.merge(bidir_copy=True).eval()
    assert both.weights.merged_bidir_tensors() and not merged.weights.merged_bidir_tensors()  # the copy held
    routed = "batched" if len(both.config.passes) == 2 else "sequential"  # one pass is always read alone
    assert both.prefill_path() == "sequential" and merged.prefill_path() == routed  # no routing over a copy
    ids, mask, answer_ids, answer_mask = prompts()
    with torch.no_grad():
        a = plain.answer_logits(plain.prefill(ids, mask), answer_ids, answer_mask)
        b = both.answer_logits(both.prefill(ids, mask), answer_ids, answer_mask)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
        torch.testing.assert_close(both(ids, mask, answer_ids, answer_mask).example_loss,  # the sequential path
                                   plain(ids, mask, answer_ids, answer_mask).example_loss, atol=1e-4, rtol=0)
    greedy = [m.generate(ids, mask, max_new_tokens=16, eos_token_id=None, pad_token_id=0) for m in (plain, both)]
    assert torch.equal(greedy[0], greedy[1])
    both.unmerge()
    assert not both.weights.merged_bidir_tensors() and both.prefill_path() == routed


def test_merge_bidir_is_a_load_option_and_excludes_no_merge(tmp_path, capsys):
    from bitune.cli import main
    from bitune.loading import load_bitune
    from helpers.gen import save_checkpoint

    ckpt, _ = save_checkpoint(tmp_path)
    model, _ = load_bitune(str(ckpt), merge="both", device="cpu")
    assert model.merged and model.weights.merged_bidir_tensors()
    with pytest.raises(BituneError, match="merge='yes'"):
        load_bitune(str(ckpt), merge="yes", device="cpu")
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--checkpoint", str(ckpt), "--merge-bidir", "--no-merge", "hi"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
