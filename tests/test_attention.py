"""The attention plumbing (bitune.attention): a block attention gets the layout of the forward that runs, only
inside it, and the model's own implementation is back afterwards, also after an error."""

from __future__ import annotations

import pytest
import torch

from bitune.attention import block_attention, mask_format, running
from helpers.models import tiny_model

SEEN = []


@block_attention("bitune_test_blocks")
def _recording(module, query, key, value, attention_mask, layout, inner, **kwargs):
    SEEN.append(layout)
    return inner(module, query, key, value, attention_mask, **kwargs)  # the model's own attention, unchanged


def test_a_block_attention_gets_its_layout_and_computes_with_the_models_own_attention():
    model = tiny_model("llama")
    ids = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        SEEN.clear()
        with running(model, "bitune_test_blocks", layout=("my", "layout")):
            blocks = model(input_ids=ids).logits
    assert SEEN == [("my", "layout")] * 2  # once per layer
    torch.testing.assert_close(blocks, plain, atol=0, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_outside_its_forward_a_block_attention_refuses_and_an_error_restores_the_implementation():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="boom"):
        with running(model, "bitune_test_blocks", layout=None):
            raise RuntimeError("boom")
    assert model.config._attn_implementation == "sdpa"
    model.config._attn_implementation_internal = "bitune_test_blocks"  # switched by hand, no layout
    with pytest.raises(RuntimeError, match="only valid inside"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long))


def test_mask_formats():
    ok = torch.tensor([[True, False]])
    assert mask_format(ok, "sdpa", torch.float32) is ok
    assert mask_format(ok, "eager", torch.bfloat16).tolist() == [[0.0, torch.finfo(torch.bfloat16).min]]
