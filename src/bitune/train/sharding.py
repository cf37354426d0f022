"""Sharded training with FSDP2 (``torch.distributed.fsdp.fully_shard``): what ``bitune train --fsdp`` adds to DDP.

Every process holds only its 1/N slice of each parameter, gradient and AdamW state (DTensors sharded on dim 0);
a unit's full parameters are all-gathered just before it runs and freed after. The units:

- **each decoder layer** (:meth:`bitune.model.BituneModel.decoder_layers`) with everything inside it: the frozen
  base weights and both weight sets' PEFT modules (LoRA, DoRA, IA3 live in the layer), gathered once per layer
  call. For ``method: full`` the bidir copy's layer ``i`` is a unit of its own: a pass runs one copy, so only the
  copy that runs is gathered;
- **the root** (the BituneModel): embeddings, final norm, lm_head (of both copies for ``full``) and the mixer's
  2L thetas. The mixer is sharded with the root, not replicated: it is used inside every layer (fused forward)
  and between passes, and the root's parameters stay gathered for the whole forward and backward, so it costs
  one small all-gather per step, its gradient is reduce-scattered like every other one (no hand-written
  all-reduce) and every gradient is a DTensor, which is what gradient clipping over sharded gradients needs.

We call ``fully_shard`` ourselves under the process group accelerate set up, rather than accelerate's FSDP2
plugin: on CPU (gloo) accelerate ignores its FSDP settings altogether (its distributed type stays MULTI_CPU); its
wrap policy shards by class name only and must prepare model and optimizer together, re-mapping the optimizer's
parameters; and this loop already owns clipping and checkpoints. An accelerate config with ``fsdp_version: 2``
is honoured (it turns this path on; ``fsdp_reshard_after_forward`` and ``fsdp_activation_checkpointing`` are
read); ``fsdp_version: 1`` and parameter offloading are refused.

Mixed precision (GPU with bf16 only): decoder layers compute with bf16 parameters and reduce gradients in fp32;
the root stays fp32 (the mixing is fp32 by definition, eq. 6-7). On CPU everything is fp32.

Checkpoints hold gathered tensors (the standard Bitune checkpoint plus the optimizer state of one process), so a
sharded run writes what a DDP run writes, and resumes exactly: weights are loaded before sharding, optimizer
state is sliced onto each process's shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import BituneError
from ..model import BituneModel
from ..processes import check_fsdp_processes


@dataclass(frozen=True)
class FsdpOptions:
    """How this run shards, from the ``fsdp`` setting and an accelerate FSDP config (its environment)."""

    shard: bool
    """Shard with FSDP2."""
    reshard_after_forward: bool | None = None
    """Free a layer's gathered weights after its forward (None: FSDP2's default, True)."""
    checkpointing: bool = False
    """The accelerate config's ``fsdp_activation_checkpointing`` (our own per-layer checkpointing runs)."""


def fsdp_options(setting: bool) -> FsdpOptions:
    """What ``fsdp`` and the accelerate environment ask for.

    ``accelerate launch --config_file configs/accelerate/fsdp.yaml`` sets ``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``
    and the other ``FSDP_*`` variables; version 2 turns sharding on.

    Raises:
        BituneError: the accelerate config asks for FSDP version 1 or for parameter offloading (not supported).
    """
    env = os.environ
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return FsdpOptions(setting)
    if env.get("FSDP_VERSION", "1") != "2":
        raise BituneError("the accelerate config asks for FSDP version 1; bitune train shards with FSDP2: set "
                          "fsdp_version: 2 (configs/accelerate/fsdp.yaml)")
    if env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise BituneError("fsdp_offload_params: true is not supported by bitune train; set it to false")
    reshard = env.get("FSDP_RESHARD_AFTER_FORWARD")
    return FsdpOptions(True, reshard.lower() == "true" if reshard else None,
                       env.get("FSDP_ACTIVATION_CHECKPOINTING", "false").lower() == "true")


def shard(model: BituneModel, bf16: bool, reshard_after_forward: bool | None = None) -> BituneModel:
    """Apply FSDP2 in place: each decoder layer, then the root (see the module docstring); returns ``model``.

    Raises:
        BituneError: no process group (run several processes), or the model has no decoder layers to wrap.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    try:
        layers = model.decoder_layers()
    except BituneError as e:
        raise BituneError(f"fsdp: cannot shard this model: {e}") from e
    check_fsdp_processes(dist.get_world_size() if dist.is_initialized() else 1)
    device = next(model.parameters()).device
    mesh = init_device_mesh("cuda" if device.type == "cuda" else "cpu", (dist.get_world_size(),))  # or meta
    fp32 = MixedPrecisionPolicy()
    layer_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else fp32
    kwargs = {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=layer_policy, **kwargs)
    fully_shard(model, mesh=mesh, mp_policy=fp32)
    return model


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor all-gathered (every process must call this, in the same order), else ``t``."""
    return t.full_tensor() if is_sharded(t) else t


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of ``t`` (its shard for a DTensor)."""
    return t.to_local() if is_sharded(t) else t


def gathered(tensors: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor] | None:
    """Every tensor whole on the CPU (one at a time, so only one full tensor is on the device); every process
    takes part, the ones with ``keep`` False get None."""
    out = {}
    for name, t in tensors.items():
        whole = full(t.detach())
        if keep:
            out[name] = whole.cpu().clone()
    return out if keep else None


def optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict[str, Any] | None:
    """The optimizer's state dict with every sharded state tensor gathered: what one unsharded process holds.
    Every process takes part; the ones with ``keep`` False get None."""
    state = optimizer.state_dict()
    out = {}
    for index, entry in state["state"].items():
        out[index] = {k: full(v).cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
    return {"state": out, "param_groups": state["param_groups"]} if keep else None


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A gathered optimizer state dict (:func:`optimizer_state`) cut to this process's shards, for
    ``optimizer.load_state_dict``: each state tensor shaped like its parameter becomes a DTensor laid out like it."""
    from torch.distributed.tensor import distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for index, entry in state["state"].items():
        p = params[index]
        out[index] = {k: distribute_tensor(v.to(local(p).device), p.device_mesh, p.placements, src_data_rank=None)
                      if is_sharded(p) and isinstance(v, torch.Tensor) and v.shape == p.shape else v
                      for k, v in entry.items()}
    return {"state": out, "param_groups": state["param_groups"]}


def total_norm(params: list[torch.Tensor]) -> float:
    """Global L2 norm of the gradients of ``params`` (sharded or not; 0 when none has one): every process gets the
    norm of the whole gradient, not of its shard."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if any(is_sharded(g) for g in grads):
        return float(full(torch.nn.utils.get_total_norm(grads, 2.0)))
    return float(torch.stack([g.float().norm() for g in grads]).norm())


def clip(params, limit: float) -> float:
    """Scale the gradients of ``params`` so that their global norm is at most ``limit``; returns the norm before.
    The norm of sharded gradients is reduced over the processes (each holds a slice), so every process scales
    by the same factor, the one an unsharded run would use."""
    return float(full(torch.nn.utils.clip_grad_norm_(params, limit)))


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
    """Bytes this process holds for parameters, gradients and optimizer state (a DTensor counts its local shard)."""
    def size(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    out = {"params": sum(size(p) for p in params),
           "grads": sum(size(p.grad) for p in params if p.grad is not None)}
    out["optimizer"] = sum(size(v) for s in (optimizer.state.values() if optimizer is not None else [])
                           for v in s.values() if isinstance(v, torch.Tensor))
    return out


__all__ = ["FsdpOptions", "fsdp_options", "shard", "gathered", "optimizer_state", "shard_optimizer_state", "total_norm", "clip",
           "state_bytes", "full", "local", "is_sharded"]
