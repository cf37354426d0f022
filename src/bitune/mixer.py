"""Learnable mixing of causal and bidirectional prompt features (paper eq. 6-7).

    K = K_causal * (1 - a_k) + K_bidir * a_k,    V = V_causal * (1 - a_v) + V_bidir * a_v,
    a = |theta| / (theta_init + |theta|),

with one theta_k and one theta_v per layer, initialised to theta_init (so a = 0.5 at the start, the paper's
choice) or, for another initial share a0, to theta_init * a0 / (1 - a0). The mixing
always runs in float32, whatever the model dtype, and the result is cast back to the cache dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import init_share_problem, start_theta


class Mixer(nn.Module):
    """Per-layer mixing coefficients.

    Args:
        num_layers: number of transformer blocks L.
        theta_init: the scale of theta in a = |theta| / (theta_init + |theta|).
        init_share: every a at the start (:attr:`bitune.config.BituneConfig.init_share`, whose default is the
            library's; the paper's 0.5 starts theta at theta_init), checked by
            :func:`bitune.config.init_share_problem`.
        states: further coefficients, for the per-row states of recurrent layers (:mod:`bitune.kinds`): ``"s"``
            mixes a recurrent state, ``"c"`` a conv state, each with its own theta per layer (``theta_s``,
            ``theta_c``), starting at the same share as K/V. Default none (attention-only models).
    """

    def __init__(self, num_layers: int, theta_init: float, init_share: float, states: tuple[str, ...] = ()):
        super().__init__()
        problem = init_share_problem(init_share, theta_init)
        if problem:
            raise ValueError(f"Mixer: {problem}")
        self.theta_init = theta_init
        start = start_theta(init_share, theta_init)
        self.theta_k = nn.Parameter(torch.full((num_layers,), start, dtype=torch.float32))  # (L,)
        self.theta_v = nn.Parameter(torch.full((num_layers,), start, dtype=torch.float32))  # (L,)
        for name in states:  # one entry per layer; a layer without such a state leaves its entry unused
            self.register_parameter(f"theta_{name}", nn.Parameter(torch.full((num_layers,), start,
                                                                             dtype=torch.float32)))  # (L,)

    def ratio(self, theta: torch.Tensor) -> torch.Tensor:
        """a = |theta| / (theta_init + |theta|), float32."""
        theta = theta.float().abs()
        return theta / (self.theta_init + theta)

    def ratios(self) -> dict[str, torch.Tensor]:
        """Current a_k and a_v (and a_s, a_c where the model has such states) per layer, each (L,) float32,
        detached."""
        return {name[len("theta_"):]: self.ratio(p).detach() for name, p in self.named_parameters()}

    def has(self, coefficient: str) -> bool:
        """Whether this mixer has the coefficient ``coefficient`` (``k``, ``v``, ``s``, ``c``)."""
        return hasattr(self, f"theta_{coefficient}")

    def mix(self, layer: int, coefficient: str, causal: torch.Tensor, bidir: torch.Tensor) -> torch.Tensor:
        """``causal (1 - a) + bidir a`` with the coefficient's a of ``layer``, in float32, returned in the input
        dtype; any shapes (keys (B, nh, T, hs), or a per-row state)."""
        a = self.ratio(getattr(self, f"theta_{coefficient}")[layer])  # () float32
        return (causal.float() * (1 - a) + bidir.float() * a).to(causal.dtype)

    def forward(self, layer: int, k_causal, k_bidir, v_causal, v_bidir) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix one layer's features of the causal and the bidirectional pass; all tensors (B, n_kv_heads, T,
        head_dim); returns (K, V) in the input dtype."""
        a_k = self.ratio(self.theta_k[layer])  # () float32
        a_v = self.ratio(self.theta_v[layer])  # () float32
        k = k_causal.float() * (1 - a_k) + k_bidir.float() * a_k  # (B, nh, T, hs) float32
        v = v_causal.float() * (1 - a_v) + v_bidir.float() * a_v  # (B, nh, T, hs) float32
        return k.to(k_causal.dtype), v.to(v_causal.dtype)
