"""The prompt passes' masks, small enough to write out by hand: the fast code's (bitune.masks) and the reference's
own (bitune.reference), each against the same hand-written tensors."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from bitune.masks import pass_mask, position_ids
from bitune.reference import _pass_mask, _positions

PADDED = torch.tensor([[0, 1, 1, 1]])  # one row: a padding token, then 3 real ones
X, o = True, False
# query row q (a position), key column k: may q read k? Padding key 0 is never read; padding query 0 reads itself
# and the real keys its pass allows (its output reaches nothing: every later query is blocked from its keys).
HAND = {
    "causal": [[X, o, o, o],
               [o, X, o, o],
               [o, X, X, o],
               [o, X, X, X]],
    "bidirectional": [[X, X, X, X],
                      [o, X, X, X],
                      [o, X, X, X],
                      [o, X, X, X]],
    "anti_causal": [[X, X, X, X],
                    [o, X, X, X],
                    [o, o, X, X],
                    [o, o, o, X]],
}
# A sliding window of 2 (Gemma 3's sliding layers): a query reads keys at distance < 2 only, on both sides when
# bidirectional. No padding here.
WINDOW_2 = {
    "causal": [[X, o, o, o],
               [X, X, o, o],
               [o, X, X, o],
               [o, o, X, X]],
    "bidirectional": [[X, X, o, o],
                      [X, X, X, o],
                      [o, X, X, X],
                      [o, o, X, X]],
}


def _builders():
    llama = LlamaConfig(num_hidden_layers=1)
    return {"masks": lambda m, kind, impl="sdpa", config=llama: pass_mask(m, kind, torch.float32, config, impl),
            "reference": lambda m, kind, impl="sdpa", config=llama: _pass_mask(m, kind, config, impl, torch.float32)}


@pytest.mark.parametrize("who", ["masks", "reference"])
@pytest.mark.parametrize("kind", sorted(HAND))
def test_pass_masks_are_the_hand_written_ones(who, kind):
    build = _builders()[who]
    expected = torch.tensor(HAND[kind])[None, None]  # (1, 1, 4, 4)
    assert torch.equal(build(PADDED, kind), expected)
    additive = build(PADDED, kind, "eager")  # eager: 0 where allowed, the dtype's minimum elsewhere
    assert torch.equal(additive == 0, expected) and (additive[~expected] == torch.finfo(torch.float32).min).all()


@pytest.mark.parametrize("who", ["masks", "reference"])
@pytest.mark.parametrize("kind", sorted(WINDOW_2))
def test_sliding_layers_get_the_window_full_layers_do_not(who, kind):
    gemma = Gemma3TextConfig(num_hidden_layers=2, sliding_window=2, layer_types=["sliding_attention", "full_attention"])
    masks = _builders()[who](torch.ones(1, 4, dtype=torch.long), kind, config=gemma)
    assert torch.equal(masks["sliding_attention"], torch.tensor(WINDOW_2[kind])[None, None])
    full = torch.ones(4, 4, dtype=torch.bool) if kind == "bidirectional" else torch.ones(4, 4, dtype=torch.bool).tril()
    assert torch.equal(masks["full_attention"], full[None, None])


@pytest.mark.parametrize("positions", [position_ids, _positions])
def test_positions_count_real_tokens_only(positions):
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
