"""Quickstart scoring on a tiny model, and a real-model training run (integration)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import VOCAB, tiny_model

from bitune import BituneConfig, BituneModel
from bitune.data.templates import Example
from bitune.quickstart import score_choices




class CharTokenizer:
    """One token per character (ids 3..VOCAB-1), pad 0: enough to score choices on a tiny model."""

    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [3 + ord(c) % (VOCAB - 3) for c in text]}


def questions() -> list[Example]:
    return [Example(prompt=f"Q{i}: pick\nAnswer:", answer=" yes", choices=[" yes", " no way", " maybe"], gold=i % 3)
            for i in range(5)]


@pytest.mark.parametrize("variant", ["pretrained", "bitune"])
def test_score_choices_matches_forward_per_choice(variant):
    transformers.set_seed(0)
    model = BituneModel.wrap(tiny_model(), BituneConfig(variant=variant))
    with torch.no_grad():
        for p in model.trainable_parameters().values():
            p.add_(torch.randn_like(p) * 0.1)
    tok = CharTokenizer()
    exs = questions()
    got = score_choices(model, tok, exs, batch_size=2)
    # reference: one ordinary forward per (question, choice), argmax of the summed token log-probs
    correct = 0
    for e in exs:
        p = torch.tensor([tok(e.prompt)["input_ids"]])
        totals = []
        for c in e.choices:
            a = torch.tensor([tok(c)["input_ids"]])
            totals.append(model(p, torch.ones_like(p), a, torch.ones_like(a)).token_logprobs.sum().item())
        correct += int(torch.tensor(totals).argmax()) == e.gold
    assert got.n == 5 and got.acc == correct / 5


@pytest.mark.integration
def test_real_model_trains_a_few_bitune_steps(tmp_path):
    from bitune.train import load_settings, train

    settings = load_settings(None, ["dataset=arc_easy", "limit=8", "steps=2", "batch_size=2", "grad_accum=1",
                                    "max_length=256", "log_every=1", "lr=1e-3", f"output_dir={tmp_path}/run"])
    result = train(settings)
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)
    assert len(log[-1]["a_k"]) == 30  # SmolLM2-135M has 30 layers
    reloaded = BituneModel.from_pretrained(result.final_dir)
    assert reloaded.config.base_model == "smollm2-135m"
