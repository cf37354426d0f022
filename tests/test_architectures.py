"""Any Hugging Face causal LM: the architecture matrix (``tests/helpers/architectures.py``).

The default suite runs one representative of each kind of architecture that needs something of its own (plain,
flattened tokens, fused MoE experts, attention code of its own, tuple-returning routers, multi-head latent
attention) and of each kind wrap refuses (recurrent models without attention, a kind not implemented, a cache of its
own layout), negative controls showing that the checks fail when the property they check is broken, and that the
Supported models page is what the committed matrix file renders. ``pytest -m architectures`` re-runs every type and compares with that file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bitune import methods
from bitune.mixer import Mixer
from bitune.support import UnsupportedModelError
from helpers import architectures as A
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
MATRIX = json.loads((ROOT / "docs" / "supported-models.json").read_text(encoding="utf-8"))


def _script():
    return load_script("architectures")


def test_supported_models_page_is_what_the_matrix_file_renders():
    assert (ROOT / "docs" / "supported-models.md").read_text(encoding="utf-8") == _script().render(MATRIX), (
        "docs/supported-models.md is stale: run python scripts/architectures.py --page")


def test_the_matrix_covers_every_causal_lm_type_and_accepts_none_it_gets_wrong():
    """Every causal-LM type of the installed transformers has a row (an upgrade that adds one fails here until the
    matrix is re-run), and no row is accepted with a failing check."""
    assert set(MATRIX["float32"]) == set(A.causal_lm_types())
    failing = {t: r for t, r in MATRIX["float32"].items() if r["status"] == "fail"}
    assert not failing, f"accepted and then wrong: {sorted(failing)}"
    assert sum(r["status"] == "pass" for r in MATRIX["float32"].values()) >= 125
    assert all(r["status"] == "pass" for r in MATRIX["bfloat16"].values()), MATRIX["bfloat16"]


@pytest.mark.parametrize("model_type", ["llama", "opt", "qwen3_moe", "falcon", "phimoe", "minicpm3"])
def test_representative_architectures_pass_every_check(model_type):
    """Plain Llama (fused path); OPT (its MLP sees flattened tokens); Qwen3-MoE (fused 3-D experts: merge);
    Falcon under sdpa (its own attention code: the fused path is switched off at wrap); PhiMoE (a router that
    subclasses nn.Linear and returns a tuple: left out of all-linear); MiniCPM3 (multi-head latent attention:
    a layer routing cannot follow)."""
    result = A.run(model_type)
    assert result.status == "pass", result.checks or result.reason
    assert result.status == MATRIX["float32"][model_type]["status"]


@pytest.mark.parametrize(("model_type", "reason"), [
    ("rwkv", "recurrent model without attention"),  # recurrent, its own cache
    ("mamba", "no layer can read later tokens"),  # recurrent: no attention layer, so no bidirectional pass
    ("inkling_text", "relative_attention"),  # a layer kind not implemented yet
    ("dory", "cache holds 6 layers for 4 decoder layers"),  # a cache of its own layout
])
def test_architectures_bitune_is_not_defined_for_are_refused_at_wrap_in_one_line(model_type, reason):
    with pytest.raises(UnsupportedModelError) as e:
        A.wrapped(model_type, A.attn_for(model_type))
    message = str(e.value)
    assert reason in message and "\n" not in message
    assert A.causal_lm_types()[model_type] in message  # names the model


# ------------------------------------------------------------------------------------------- negative controls
def test_the_correctness_check_fails_when_a_wrong_fast_path_is_kept(monkeypatch):
    """Falcon's fused forward disagrees with its passes; with wrap's check made blind, check_correct says so."""
    monkeypatch.setattr("bitune.probe.agree", lambda a, b: True)
    problem = A.check_correct("falcon", "sdpa", torch.float32)
    assert problem is not None and "fused path" in problem


def test_the_correctness_check_fails_when_the_bidirectional_pass_is_causal(monkeypatch):
    """GPT-Neo's own causal mask (its buffers left closed) makes the bidirectional pass causal; with wrap's check
    made blind, the matrix's check finds it."""
    monkeypatch.setattr("bitune.model.open_own_masks", lambda model: (lambda: None))
    monkeypatch.setattr("bitune.probe.passes_obey_masks", lambda *args: None)
    problem = A.check_correct("gpt_neo", "eager", torch.float32)
    assert problem is not None


def test_the_merge_check_fails_when_expert_weights_are_not_merged_for_the_bidirectional_pass(monkeypatch):
    """A merge that keeps no bidirectional copy of the fused expert weights runs the bidir pass with the causal
    experts: check_merge must see the logits move."""
    original = methods.merged_copy

    def without_experts(layer, name):
        base, tensors = original(layer, name)
        return base, {} if hasattr(layer, "parameter_name") else tensors

    monkeypatch.setattr(methods, "merged_copy", without_experts)
    notes = []
    assert A.check_merge("qwen3_moe", "sdpa", torch.float32, notes) is None and "declined" in notes[0]  # merge sees it
    monkeypatch.setattr("bitune.probe.agree", lambda a, b: True)  # merge's own check made blind
    assert A.check_merge("qwen3_moe", "sdpa", torch.float32) is not None


# ------------------------------------------------------------------------------- hybrids: layers that keep states
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h", "lfm2", "gpt_neo"])
def test_hybrid_architectures_pass_every_check(model_type):
    """Qwen3.5 (Gated DeltaNet + attention), Nemotron-H (Mamba2 + attention + MLP-only layers), LFM2 (convolutions
    + attention), GPT-Neo (global and local layers whose own masks wrap opens): every check of the matrix, the state checks included (share 0 keeps the causal pass's states
    exactly, a padded row equals its prompt alone, every state coefficient learns)."""
    result = A.run(model_type)
    assert result.status == "pass", result.checks or result.reason
    assert result.status == MATRIX["float32"][model_type]["status"]


def test_the_state_check_fails_when_recurrent_layers_get_the_4d_mask(monkeypatch):
    """Recurrent layers zero padded positions only when given the 2D padding mask; handed the pass's 4D mask alone
    (one mask for the whole model, as before layer kinds: the model passes its linear layers no padding mask), a
    left-padded row's state takes in its padding: check_states sees it differ from the prompt alone."""
    from bitune import masks
    one_mask = masks.per_layer_type
    monkeypatch.setattr(masks, "per_layer_type", lambda build, config, layers=None, padding=None: one_mask(build, config))
    problem = A.check_states("qwen3_5_text", "sdpa", torch.float32)
    assert problem is not None and "alone" in problem


def test_the_correctness_check_fails_when_states_are_not_mixed(monkeypatch):
    """A mixer that mixes keys and values but leaves the causal pass's states (share > 0 changes nothing there)
    disagrees with the reference, which mixes them."""
    has = Mixer.has
    monkeypatch.setattr(Mixer, "has", lambda self, c: c in "kv" and has(self, c))
    assert A.check_correct("qwen3_5_text", "sdpa", torch.float32) is not None


def test_the_training_check_fails_when_states_are_written_in_place(monkeypatch):
    """transformers' recurrent cache layer copies a new state into the old tensor; on a mixed state the answer
    pass's write breaks the backward (the cache's assigning layers prevent it)."""
    monkeypatch.setattr("bitune.cache.assigning", lambda layer: None)
    with pytest.raises(RuntimeError, match="inplace"):
        A.check_train(A.wrapped("qwen3_5_text", "sdpa"))


def test_the_training_check_fails_when_the_thetas_get_no_gradient(monkeypatch):
    ratio = Mixer.ratio
    monkeypatch.setattr(Mixer, "ratio", lambda self, theta: ratio(self, theta).detach())  # mixes, learns nothing
    assert "theta" in A.check_train(A.wrapped("llama", "sdpa"))


# ------------------------------------------------------------------------------------------- the whole matrix
@pytest.mark.architectures
@pytest.mark.parametrize("model_type", sorted(A.causal_lm_types()))
def test_every_architecture_keeps_its_recorded_status(model_type):
    recorded = MATRIX["float32"].get(model_type)
    assert recorded is not None, f"{model_type} is new in this transformers: run python scripts/architectures.py"
    result = A.run(model_type)
    assert result.status == recorded["status"], (result.checks, result.reason)


@pytest.mark.architectures
@pytest.mark.parametrize("model_type", sorted(MATRIX["bfloat16"]))
def test_popular_architectures_pass_in_bfloat16(model_type):
    result = A.run(model_type, dtype=torch.bfloat16)
    assert result.status == "pass", result.checks or result.reason


def test_readme_and_site_quote_the_matrix_counts():
    rows = MATRIX["float32"].values()
    passed = sum(r["status"] == "pass" for r in rows)
    tested = sum(r["status"] not in ("out_of_scope", "no_tiny") for r in rows)
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    index = " ".join((ROOT / "docs" / "index.md").read_text(encoding="utf-8").split())
    assert f"{passed} of {tested} " in readme
    assert f"{passed} of the {tested} " in index


# ------------------------------------------------------------------------------------- a refusal is a starting point
def test_a_refusal_leaves_the_callers_model_as_it_was_given_and_says_what_works_instead(monkeypatch):
    """A model whose attention keeps a causal mask of its own (GPT-Neo with its buffers left closed) is refused
    after the adapters were added: it comes back with the same modules, parameters, values, buffers and trainable
    flags, and the one-line error names the baseline and the page."""
    from bitune import BituneConfig, BituneModel

    monkeypatch.setattr("bitune.model.open_own_masks", lambda model: (lambda: None))  # buffers left closed
    base = A.tiny_model("gpt_neo", "eager")
    buffers = {name: b.clone() for name, b in base.named_buffers()}
    modules = [name for name, _ in base.named_modules()]
    before = {name: (p.requires_grad, p.detach().clone()) for name, p in base.named_parameters()}
    with pytest.raises(UnsupportedModelError) as e:
        BituneModel.wrap(base, BituneConfig())
    message = str(e.value)
    assert "\n" not in message and "methods/lora" in message and "supported-models" in message
    assert [name for name, _ in base.named_modules()] == modules
    after = dict(base.named_parameters())
    assert set(after) == set(before)
    assert all(after[n].requires_grad == flag and torch.equal(after[n], value) for n, (flag, value) in before.items())
    assert all(torch.equal(b, buffers[name]) for name, b in base.named_buffers())


def test_a_refusal_puts_back_the_masks_wrap_opened(monkeypatch):
    """GPT-Neo's buffers are opened at wrap; a refusal after that (here: a probe that refuses) closes them again."""
    from bitune import BituneConfig, BituneModel
    from bitune.support import refuse

    def refusing(model):
        raise refuse(model.weights.base, "refused for the test")

    monkeypatch.setattr("bitune.probe.check_wrapped", refusing)
    base = A.tiny_model("gpt_neo", "eager")
    buffers = {name: b.clone() for name, b in base.named_buffers()}
    with pytest.raises(UnsupportedModelError):
        BituneModel.wrap(base, BituneConfig())
    assert all(torch.equal(b, buffers[name]) for name, b in base.named_buffers())


@pytest.mark.parametrize("model_type", ["gpt_neo", "mamba"])
def test_the_lora_baseline_trains_and_generates_on_models_bitune_refuses(model_type):
    """Plain LoRA needs no prompt passes: GPT-Neo (a causal mask of its own) and Mamba (no attention) train, and
    greedy generation equals PEFT's own."""
    from bitune import BituneConfig, BituneModel

    model = BituneModel.wrap(A.tiny_model(model_type, A.attn_for(model_type)), BituneConfig(variant="lora"))
    p, pm, a, am = A._batch()
    model.train()
    out = model(p, pm, a, am)
    out.loss.backward()
    assert torch.isfinite(out.loss) and any(t.grad is not None and t.grad.abs().sum() > 0
                                            for t in model.trainable_parameters().values())
    model.eval()
    with torch.no_grad():
        row = p[1:]  # an unpadded prompt
        got = model.generate(row, torch.ones_like(row), max_new_tokens=4, eos_token_id=None, pad_token_id=0)
        want = model.weights.model.generate(input_ids=row, attention_mask=torch.ones_like(row), max_new_tokens=4,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)[:, row.shape[1]:]
    assert torch.equal(got, want)


def test_train_dry_run_runs_the_wrap_checks_of_the_real_run(tmp_path, capsys):
    """--dry-run refuses what the run would refuse (Bitune on Mamba, which has no attention layer) and passes what
    it would take (its LoRA baseline), loading the model as the run does."""
    from bitune.cli import main
    from helpers.tokenizer import tiny_tokenizer

    base = tmp_path / "mamba"
    A.tiny_model("mamba", "eager").save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    argv = ["train", "--set", f"model={base}", "--set", f"output_dir={tmp_path / 'run'}", "--dry-run"]
    assert main(argv) == 2
    assert "not supported by Bitune" in capsys.readouterr().err.strip().splitlines()[-1]
    assert main([*argv, "--set", "bitune.variant=lora"]) == 0
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "deepseek_v32"])
def test_recompute_on_layers_that_keep_more_than_kv_keeps_loss_and_gradients(model_type):
    """Bitune's activation checkpointing replays each layer in the backward pass; on recurrent and conv layers the
    replay must read the states the first run found and write none (no conv state appended twice), on indexed
    layers (DSA) it must not append the indexer's keys twice: loss and every gradient equal the run without it."""
    results = []
    for recompute in (False, True):
        model = A.wrapped(model_type, "sdpa")
        if recompute:
            model.enable_recompute()
        model.train()
        out = model(*A._batch())
        out.loss.backward()
        results.append((out.loss.detach(), {k: p.grad.clone() for k, p in model.trainable_parameters().items()
                                             if p.grad is not None}))
    (loss, grads), (loss_r, grads_r) = results
    torch.testing.assert_close(loss_r, loss, atol=1e-6, rtol=0)
    assert grads.keys() == grads_r.keys()
    assert model_type == "deepseek_v32" or any(k.startswith(("mixer:theta_s", "mixer:theta_c")) for k in grads)
    for k in grads:
        torch.testing.assert_close(grads_r[k], grads[k], atol=1e-5, rtol=1e-4)
