"""Packed scoring (several continuations of a prompt in one row) == each continuation in its own answer pass."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from bitune import BituneConfig, BituneModel
from bitune.outputs import token_logprobs
from bitune.passes import Prefill
from bitune.scoring import blocks, pack, score_continuations
from helpers.models import COMMON, VOCAB, perturb_adapters, tiny_model


def scored(model, prefill, continuations):
    """score_continuations on a BituneModel's parts."""
    return score_continuations(model.weights, model.text_config, prefill, continuations)


def model_for(arch: str, attn: str, variant: str) -> BituneModel:
    if arch == "mistral_window4":  # one layer type, every layer sliding, window shorter than the prompts
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(MistralConfig(num_key_value_heads=2, sliding_window=4, **COMMON),
                                                attn_implementation=attn).eval()
    else:
        base = tiny_model(arch, attn=attn)
    model = BituneModel.wrap(base, BituneConfig(variant=variant))
    return (perturb_adapters(model, scale=0.3) if variant != "pretrained" else model).eval()


def prompts_and_choices(seed: int = 0):
    """Left-padded prompts of 3-9 tokens (longer than gemma3's window of 4), 1-4 continuations of 1-6 tokens."""
    g = torch.Generator().manual_seed(seed)
    lens = [9, 3, 6, 5]
    P = max(lens)
    ids = torch.zeros(len(lens), P, dtype=torch.long)
    mask = torch.zeros(len(lens), P, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, P - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[r, P - n:] = 1
    choices = [[torch.randint(3, VOCAB, (int(k),), generator=g).tolist() for k in sizes]
               for sizes in ([1, 4, 2, 6], [3], [5, 1], [2, 2, 6])]
    return ids, mask, choices


def alone(model: BituneModel, prefill, r: int, cont: list[int]) -> tuple[float, bool]:
    """One continuation in its own answer pass on a copy of prompt r's cache."""
    ids = torch.tensor([cont])
    mask = torch.ones_like(ids)
    logits = model.answer_logits(prefill.select(torch.tensor([r])), ids, mask)
    return float(token_logprobs(logits, ids, mask).sum()), bool((logits.argmax(-1) == ids).all())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "mistral_window4"])
@pytest.mark.parametrize("variant", ["pretrained", "bitune"])
def test_packed_scores_equal_separate_answer_passes(arch, attn, variant):
    model = model_for(arch, attn, variant)
    ids, mask, choices = prompts_and_choices()
    with torch.no_grad():
        prefill = model.prefill(ids, mask)
        expected = [alone(model, prefill, r, c) for r, conts in enumerate(choices) for c in conts]
        packed = scored(model, prefill, choices)
        again = scored(model, prefill, choices)  # the prefill is left as it was
        skip = scored(model, prefill, [choices[0], [], choices[2], []])  # rows left out
    assert len(packed) == len(expected)
    for (a, ga), (b, gb) in zip(packed, expected):
        assert a == pytest.approx(b, abs=1e-5)
        assert ga == gb
    assert [a for a, _ in again] == pytest.approx([a for a, _ in packed], abs=1e-6)
    kept = expected[:len(choices[0])] + expected[len(choices[0]) + len(choices[1]):][:len(choices[2])]
    assert [a for a, _ in skip] == pytest.approx([a for a, _ in kept], abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral_window4"])
def test_prefills_of_different_lengths_concatenated_score_the_same(arch):
    """Two chunks read apart (prompts of 9/6 and of 3/2 tokens: longer and shorter than the window of 4), joined
    by Prefill.concat (left padding and caches padded alike) and scored in one packed pass."""
    model = model_for(arch, "sdpa", "bitune")
    ids, mask, choices = prompts_and_choices()
    first, second = (0, 2), (1, 3)
    with torch.no_grad():
        parts = []
        for rows in (first, second):
            index = torch.tensor(rows)
            keep = int(mask[index].sum(1).max())  # trim to the chunk's own longest prompt
            parts.append(model.prefill(ids[index][:, -keep:], mask[index][:, -keep:]))
        expected = [score for part, rows in zip(parts, (first, second))
                    for score in scored(model, part, [choices[r] for r in rows])]
        joined = Prefill.concat(parts)
        got = scored(model, joined, [choices[r] for r in first + second])
    assert joined.mask.shape == (4, 8)  # the prompt passes read all but the last token
    assert [a for a, _ in got] == pytest.approx([a for a, _ in expected], abs=1e-5)
    assert [g for _, g in got] == [g for _, g in expected]


@pytest.mark.parametrize("method", ["dora", "ia3", "full"])
def test_packed_scores_with_other_weight_methods(method):
    """The packed pass runs the causal weights as the plain answer pass does, whatever holds them."""
    base = tiny_model("llama")
    model = BituneModel.wrap(base, BituneConfig(variant="bitune", method=method))
    model = perturb_adapters(model, scale=0.3).eval()
    ids, mask, choices = prompts_and_choices(seed=1)
    with torch.no_grad():
        prefill = model.prefill(ids, mask)
        expected = [alone(model, prefill, r, c) for r, conts in enumerate(choices) for c in conts]
        packed = scored(model, prefill, choices)
    assert [a for a, _ in packed] == pytest.approx([a for a, _ in expected], abs=1e-5)
    assert [g for _, g in packed] == [g for _, g in expected]


def test_greedy_flag_follows_the_argmax_continuation():
    model = model_for("llama", "sdpa", "bitune")
    ids, mask, _ = prompts_and_choices()
    with torch.no_grad():
        prefill = model.prefill(ids[:1], mask[:1])
        best = int(model.answer_logits(prefill, torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.long))[0, 0]
                   .argmax())
        other = (best + 1) % VOCAB
        scores = scored(model, prefill, [[[best], [other]]])
    assert [greedy for _, greedy in scores] == [True, False]


def test_pack_layout():
    """Per prompt, x_P once and each continuation without its last token; x_P predicts every first token."""
    packed = pack([9, 7], [[[5, 6, 7], [8], [3, 4]], [[2, 2]]])
    assert packed.ids.tolist() == [9, 5, 6, 3, 7, 2]
    assert packed.row.tolist() == [0, 0, 0, 0, 1, 1]
    assert packed.branch.tolist() == [0, 1, 1, 3, 0, 1]
    assert packed.offset.tolist() == [0, 1, 2, 1, 0, 1]
    assert packed.targets.tolist() == [5, 6, 7, 8, 3, 4, 2, 2]
    assert packed.columns.tolist() == [0, 1, 2, 0, 0, 3, 4, 5]
    assert packed.owner.tolist() == [0, 0, 0, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="empty continuation"):
        pack([9], [[[]]])


def test_blocks_group_prompts_of_similar_length_and_read_back_in_packed_order():
    """Rows longest first, a new group where a row is under half its group's longest; every packed position is
    read from exactly one real slot, and ``back`` puts them in packed order."""
    spans = [3, 10, 1, 6, 5, 2]  # positions per packed prompt
    packed = pack(list(range(len(spans))), [[list(range(n))] for n in spans])  # one continuation of n tokens each
    layout = blocks(packed, len(spans))
    assert layout.order.tolist() == [1, 3, 4, 0, 5, 2]  # lengths 10, 6, 5, 3, 2, 1
    assert layout.groups == [(0, 3, 10), (3, 5, 3), (5, 6, 1)]
    read = torch.cat([layout.index[a:b, :n][layout.real[a:b, :n]] for a, b, n in layout.groups])
    assert read[layout.back].tolist() == list(range(packed.ids.shape[0]))
    assert (packed.row[layout.index] == layout.order[:, None]).all()  # a row's slots are its prompt's positions
