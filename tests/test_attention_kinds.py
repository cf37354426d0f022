"""Attention layers of kinds beyond the paper's (bitune.kinds): ALiBi (Bloom, MPT), chunked (Llama 4) and indexed
(DeepSeek-V3.2's DSA) attention, each against a definition that does not share the code under test, with a
negative control that breaks the kind's rule and must be caught; and the refusal of a cache of its own layout."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bitune import BituneConfig, BituneModel
from bitune.attention import symmetric_alibi
from bitune.kinds import Layers
from bitune.masks import allowed, pass_mask, position_ids
from bitune.reference import reference_logits
from bitune.support import UnsupportedModelError
from helpers import architectures as A


def _hidden(model, ids: torch.Tensor, mask) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return out.hidden_states[-1][0]  # (T, d)


# ------------------------------------------------------------------------------------------------------ ALiBi
@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_bias_is_symmetric_in_a_bidirectional_pass(model_type):
    """Bloom and MPT carry no position information but their ALiBi bias. With the bias made symmetric, -m|i - j|,
    a bidirectional forward is equivariant under reversing the tokens (every |i - j| is kept); the model's own bias,
    m x key position, favours the last tokens and breaks it (MPT's own builder reads a 4D mask: the control)."""
    model = A.tiny_model(model_type, "eager")
    ids = torch.randint(3, A.VOCAB, (1, 7), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    full = pass_mask(ones, "bidirectional", torch.float32, model.config, "eager")
    undo = symmetric_alibi(model)
    with torch.no_grad():
        forward, backward = _hidden(model, ids, full), _hidden(model, ids.flip(1), full)
    torch.testing.assert_close(backward.flip(0), forward, atol=1e-5, rtol=1e-5)
    undo()
    if model_type == "mpt":
        with torch.no_grad():
            forward, backward = _hidden(model, ids, full), _hidden(model, ids.flip(1), full)
        assert (backward.flip(0) - forward).abs().max() > 1e-3


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_causal_pass_equals_the_models_own(model_type):
    """Under the causal pass's 4D mask the symmetric bias gives the model's own logits (its 2D-mask forward), left
    padding included: the slopes are the model's; after restoring, the builders are the class's again."""
    model = A.tiny_model(model_type, "eager")
    ids = torch.randint(3, A.VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits
        undo = symmetric_alibi(model)
        ours = model(input_ids=ids, attention_mask=pass_mask(mask, "causal", torch.float32, model.config, "eager"),
                     position_ids=position_ids(mask)).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], own[real], atol=1e-5, rtol=1e-5)
    undo()
    assert not any(n in vars(m) for m in model.modules() for n in ("build_alibi_tensor", "build_mpt_alibi_tensor"))


# ---------------------------------------------------------------------------------------------------- chunks
def test_chunk_mask_matches_its_definition():
    """A query reads a key only within its chunk, chunk = real-token position // size (left padding not counted),
    and the pass's direction; every query reads itself."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    for kind in ("causal", "bidirectional"):
        got = allowed(mask, kind, None, chunk=3)[:, 0]
        pos = position_ids(mask)
        for b in range(2):
            for q in range(8):
                for k in range(8):
                    want = bool(mask[b, k]) and pos[b, q] // 3 == pos[b, k] // 3 and (kind != "causal" or k <= q)
                    assert bool(got[b, q, k]) == (want or q == k), (kind, b, q, k)


def test_chunked_passes_equal_the_reference_and_ignoring_chunks_is_caught():
    """Llama 4 with chunks of 4 and prompts that cross them: Bitune's passes give the reference's logits (its own
    chunk masks); passes that ignore the chunks (full attention in chunked layers) do not."""
    model = A._perturb(A.wrapped("llama4_text", "sdpa"))
    tensors = A._batch()
    with torch.no_grad():
        ref = reference_logits(model, *tensors)
        got = model(*tensors).logits
        assert A._close(got, ref, 1e-5, "chunked") is None
        kinds = model.layer_kinds
        model.layer_kinds = Layers([replace(k, chunk=None) for k in kinds.kinds], kinds.types)
        wrong = model(*tensors).logits
    assert (wrong - ref).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------- indexed (DSA)
def _dsa(topk: int = 3) -> BituneModel:
    """A tiny DeepSeek-V3.2 whose indexer keeps 3 of a prompt's keys, so which keys it ranks decides what is read."""
    config = A.tiny_config("deepseek_v32")
    config.index_topk = topk
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    return A._perturb(BituneModel.wrap(base, BituneConfig(method="lora", rank=4)))


def test_indexed_passes_mix_the_indexer_keys_as_the_reference_does():
    """The answer's indexer ranks the mixed prompt: the indexer keys are mixed with a_k, as in the reference; a
    kind that leaves the causal pass's indexer keys is caught (different tokens selected, different logits)."""
    model = _dsa()
    tensors = A._batch()
    with torch.no_grad():
        ref = reference_logits(model, *tensors)
        assert A._close(model(*tensors).logits, ref, 1e-5, "indexed") is None
        kinds = model.layer_kinds
        unmixed = [replace(k, mix=tuple(m for m in k.mix if m[0] != "indexer_keys")) for k in kinds.kinds]
        model.layer_kinds = Layers(unmixed, kinds.types)
        wrong = model(*tensors).logits
    assert (wrong - ref).abs().max() > 1e-4


def test_the_bidirectional_indexer_selects_later_keys():
    """In the bidirectional pass the indexer ranks every prompt key (it masks with the pass's mask before its
    top-k): some query selects a later key; in the causal pass none does (of those with top-k earlier keys)."""
    model = _dsa()
    picked = []
    indexer = model.weights.base.get_decoder().layers[0].self_attn.indexer
    indexer.register_forward_hook(lambda module, args, out: picked.append(out))
    ids = torch.randint(3, A.VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.prompt_caches(ids, torch.ones_like(ids))
    # queries from position 2 have at least top-k (3) keys to rank causally (before it, masked keys fill the top-k)
    later = [bool((p[:, 2:].long() > torch.arange(2, p.shape[1])[None, :, None]).any()) for p in picked]
    assert later == [False, True]  # the causal pass, then the bidirectional one


def test_a_conversation_on_indexed_layers_extends_their_indexer_keys():
    """Chat's alternating mode reads a new turn on top of the conversation's cache: at share 0 the answer is the
    plain causal continuation of the whole history, which needs every layer's indexer keys extended by both passes
    (a pass stopped after the last layer's keys, before its indexer keys, fails here)."""
    model = _dsa()
    with torch.no_grad():
        for theta in model.mixer.parameters():
            theta.zero_()
    g = torch.Generator().manual_seed(0)
    p1, p2 = torch.randint(3, A.VOCAB, (1, 6), generator=g), torch.randint(3, A.VOCAB, (1, 4), generator=g)
    opts = dict(max_new_tokens=4, eos_token_id=None, pad_token_id=A.PAD, return_state=True)
    with torch.no_grad():
        new1, state = model.generate(p1, torch.ones_like(p1), **opts)
        new2, _ = model.generate(p2, torch.ones_like(p2), past=state, **opts)
        ids = torch.cat([p1, new1, p2], 1)
        for _ in range(4):  # greedy, a plain causal forward of the causal weights over everything so far
            ids = torch.cat([ids, model.weights.call("causal", input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(new2, ids[:, -4:])


# ---------------------------------------------------------------------------------------------------- refusals
def test_a_cache_of_its_own_layout_is_refused_in_one_line():
    """Dory keeps copies of its recurrent layers' cache per loop (more cache layers than decoder layers): refused,
    naming the counts, rather than failing inside a pass."""
    with pytest.raises(UnsupportedModelError, match="cache holds 6 layers for 4 decoder layers"):
        BituneModel.wrap(A.tiny_model("dory"), BituneConfig(method="lora", rank=4))


def test_alibi_built_by_a_module_function_is_refused():
    """Falcon's ``alibi=True`` builds its bias with a module function wrap does not replace: refused, named."""
    from transformers import FalconConfig, FalconForCausalLM
    config = FalconConfig(vocab_size=A.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True)
    with pytest.raises(UnsupportedModelError, match="ALiBi attention biases: ALiBi position biases built by a module"):
        BituneModel.wrap(FalconForCausalLM(config).eval(), BituneConfig(method="lora", rank=4))
