"""The mixing of eq. 6-7 on numbers small enough to check by hand: the fast code's Mixer and the reference's."""

from __future__ import annotations

import pytest
import torch

from bitune.config import PAPER_INIT_SHARE
from bitune.mixer import Mixer
from bitune.reference import _ratio
from helpers.models import tiny_bitune

# theta_init = 0.01: a = |theta| / (0.01 + |theta|)
THETAS = [0.01, 0.03, -0.01, 0.0]
RATIOS = [0.5, 0.75, 0.5, 0.0]  # 0.01/0.02, 0.03/0.04, |-0.01|/0.02, 0/0.01


def test_ratio_is_the_papers_formula_by_hand():
    mixer = Mixer(num_layers=4, theta_init=0.01, init_share=PAPER_INIT_SHARE)
    assert mixer.ratios()["k"].tolist() == [0.5] * 4  # theta starts at theta_init: a = 0.5
    theta = torch.tensor(THETAS)
    assert mixer.ratio(theta).tolist() == pytest.approx(RATIOS, abs=1e-7)
    assert _ratio(theta, 0.01).tolist() == pytest.approx(RATIOS, abs=1e-7)


def test_mixing_by_hand_per_layer_and_in_float32():
    mixer = Mixer(num_layers=2, theta_init=0.01, init_share=PAPER_INIT_SHARE)
    with torch.no_grad():
        mixer.theta_k.copy_(torch.tensor([0.03, 0.01]))  # a_k = 0.75, 0.5
        mixer.theta_v.copy_(torch.tensor([0.0, -0.03]))  # a_v = 0, 0.75
    k_c, k_b = torch.full((1, 1, 2, 2), 4.0), torch.full((1, 1, 2, 2), 8.0)  # (B, nh, T, hs)
    v_c, v_b = torch.full((1, 1, 2, 2), 2.0), torch.full((1, 1, 2, 2), -2.0)
    k, v = mixer(0, k_c, k_b, v_c, v_b)
    assert k.unique().tolist() == [4 * 0.25 + 8 * 0.75] and v.unique().tolist() == [2.0]  # 7, and a_v = 0
    k, v = mixer(1, k_c, k_b, v_c, v_b)
    assert k.unique().tolist() == [6.0] and v.unique().tolist() == [2 * 0.25 - 2 * 0.75]  # -1
    # bf16 features come back in bf16: the float32 mix 1 + 0.75 * 2^-7, rounded to bf16
    k, _ = mixer(0, torch.ones(1, 1, 1, 1, dtype=torch.bfloat16), torch.full((1, 1, 1, 1), 1 + 2 ** -7,
                 dtype=torch.bfloat16), v_c.bfloat16()[..., :1, :1], v_b.bfloat16()[..., :1, :1])
    assert k.dtype == torch.bfloat16 and k.item() == torch.tensor(1 + 0.75 * 2 ** -7).bfloat16().item()


def test_a_wrapped_model_mixes_with_theta_init_from_its_config():
    model = tiny_bitune(theta_init=0.02)
    assert model.mixer.theta_init == 0.02 and model.mixing_ratios()["v"].tolist() == pytest.approx([0.1, 0.1])
