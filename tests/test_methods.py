"""The training methods' strategies: every method a config accepts has one, and each says which parameters
its weight sets train: two disjoint sets, and nothing else trains."""

from __future__ import annotations

import pytest

from bitune.config import METHODS
from bitune.methods import STRATEGIES
from helpers.models import tiny_bitune


def test_every_method_has_one_strategy():
    assert set(STRATEGIES) == set(METHODS)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_two_sets_train_apart_and_are_all_that_trains(method):
    model = tiny_bitune(variant="bitune", method=method)
    weights = model.weights
    causal, bidir = (weights.parameters_of(name) for name in ("causal", "bidir"))
    assert causal and bidir
    assert not {id(p) for p in causal.values()} & {id(p) for p in bidir.values()}
    trainable = {id(p) for p in weights.parameters() if p.requires_grad}  # wrap froze what no gradient reaches
    assert trainable and trainable <= {id(p) for p in [*causal.values(), *bidir.values()]}
    assert weights.routable == (method == "lora")


def test_a_variant_without_weight_sets_trains_nothing():
    weights = tiny_bitune(variant="pretrained").weights
    assert not weights.peft and not any(p.requires_grad for p in weights.parameters())
