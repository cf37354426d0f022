"""``bitune bench sharding``: what each training process holds under DDP and under FSDP2, and the activation
memory with and without activation checkpointing.

Starts N processes (``torch.distributed.run``, gloo on CPU); each builds the Bitune model (``--method``, default
``full``: two whole weight copies), wraps it as ``bitune train`` does (DDP, or :func:`bitune.train.sharding.shard`),
optionally with per-layer activation checkpointing, takes one AdamW step on a random batch and counts:

- **static bytes** per process: parameters + gradients + AdamW state, each DTensor counted by its local shard
  (:func:`bitune.train.sharding.state_bytes`). DDP replicates all three (its gradient buckets, one more gradient
  copy, are not counted); FSDP2 holds 1/N of each;
- **activation bytes**: the distinct storages autograd saves for the backward during the step's forward
  (:class:`bitune.bench.helpers.SavedBytes`; parameters and views of them excluded): deterministic, and what
  checkpointing cuts.

``--meta`` builds the model on the meta device and counts the static bytes without a step (parameters, gradients
and AdamW state are created as meta tensors of the shapes a step would make), for models whose replicated state
does not fit this machine; the activation bytes then come from one forward of the main process on a model of the
same shapes with random weights (no backward, no optimizer). The meta model cannot run the probe that freezes the bidir weights no gradient
reaches (the last layer's q, o and MLP), so it counts their gradients and AdamW state too: slightly more than a
real step (compare both on a model that fits).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from .helpers import count_saved, random_batch, write_json

RUNS = [("ddp", False), ("ddp", True), ("fsdp", False), ("fsdp", True)]


def bench_sharding(args) -> dict:
    """Launch the worker in ``args.num_processes`` processes and return (and print) rank 0's measurements."""
    if args.num_processes < 2:
        raise ValueError("bench sharding needs --num-processes >= 2 (it compares DDP with FSDP2)")
    if args.prompt < 2 or args.answer < 1 or args.batch_size < 1:
        raise ValueError("bench sharding needs --prompt >= 2, --answer >= 1 and --batch-size >= 1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.num_processes}",
               "-m", "bitune.bench.sharding", "--model", args.model, "--method", args.method,
               "--prompt", str(args.prompt), "--answer", str(args.answer), "--batch-size", str(args.batch_size),
               "--out", str(out)] + (["--meta"] if args.meta else [])
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(args.threads or 1))
        code = subprocess.call(cmd, env=env)
        if code != 0 or not out.is_file():
            raise ValueError(f"bench sharding: the worker processes failed (exit status {code})")
        result = json.loads(out.read_text())
    render(result)
    return result


def render(result: dict) -> None:
    """Print a record of :func:`bench_sharding` as a table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Per-process training memory, {result['model']} method {result['method']}, "
                        f"{result['processes']} processes, batch {result['batch_size']} x "
                        f"P={result['prompt']} A={result['answer']}" + (" (meta: static only)" if result["meta"] else ""))
    for col in ("wrap", "checkpointing", "params MB", "grads MB", "AdamW MB", "static MB", "/ DDP",
                "activations MB"):
        table.add_column(col, justify="right")
    for r in result["runs"]:
        act = "" if r["activation_bytes"] is None else f"{r['activation_bytes'] / 2**20:.1f}"
        table.add_row(r["wrap"], "on" if r["checkpointing"] else "off", *(f"{r[k] / 2**20:.1f}" for k in
                      ("params", "grads", "optimizer", "static")), f"{r['static_vs_ddp']:.3f}", act)
    Console().print(table)


# ----------------------------------------------------------------------------------------------- the worker
def _model(name: str, method: str, meta: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..config import BituneConfig
    from ..hub import load_model, resolve_model
    from ..model import BituneModel

    config = BituneConfig(variant="bitune", method=method)
    if not meta:
        base, _ = load_model(name)
        return BituneModel.wrap(base, config).train()
    hf_config = AutoConfig.from_pretrained(resolve_model(name))
    with torch.device("meta"):  # shapes only; the last layer's unused bidir weights are not found (not frozen)
        return BituneModel.wrap(AutoModelForCausalLM.from_config(hf_config), config).train()


def _measure(args, wrap: str, checkpointing: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from ..train import sharding

    torch.manual_seed(0)
    model = _model(args.model, args.method, args.meta)
    if checkpointing:
        model.enable_recompute()
    trained = sharding.shard(model, bf16=False) if wrap == "fsdp" else (
        model if args.meta else DistributedDataParallel(model, find_unused_parameters=False))
    params = list(model.trainable_parameters().values())
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    saved = None
    if args.meta:  # what one step creates: a gradient and two AdamW moments per trained parameter
        for p in params:
            p.grad = torch.zeros_like(p)
            optimizer.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
    else:
        batch = random_batch(model.text_config.vocab_size, args.batch_size, args.prompt, args.answer)
        with count_saved() as counter:
            loss = trained(*batch).loss
        loss.backward()
        sharding.clip(params, 1.0)
        optimizer.step()
        saved = counter.activations
    held = sharding.state_bytes(model, optimizer)
    return {"wrap": wrap, "checkpointing": checkpointing, **held, "static": sum(held.values()),
            "activation_bytes": saved}


def _activations(args) -> dict[bool, int]:
    """Activation bytes of one forward with checkpointing off and on, on a model of the same shapes with random
    weights (what autograd saves depends on shapes, not values)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..config import BituneConfig
    from ..hub import resolve_model
    from ..model import BituneModel

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve_model(args.model)))
    model = BituneModel.wrap(base, BituneConfig(variant="bitune", method=args.method)).train()
    batch = random_batch(model.text_config.vocab_size, args.batch_size, args.prompt, args.answer)
    out = {}
    for checkpointing in (False, True):
        if checkpointing:
            model.enable_recompute()
        with count_saved() as counter:
            model(*batch)
        out[checkpointing] = counter.activations
    return out


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    for name, kind in (("--model", str), ("--method", str), ("--prompt", int), ("--answer", int),
                       ("--batch-size", int), ("--out", str)):
        parser.add_argument(name, type=kind, required=True)
    parser.add_argument("--meta", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    if args.meta:  # static bytes on meta tensors; activations from one real forward of rank 0 (random weights)
        static = {wrap: _measure(args, wrap, False) for wrap in ("ddp", "fsdp")}
        acts = _activations(args) if dist.get_rank() == 0 else {}
        dist.barrier()
        runs = [{**static[wrap], "checkpointing": ckpt, "activation_bytes": acts.get(ckpt)} for wrap, ckpt in RUNS]
    else:
        runs = [_measure(args, wrap, ckpt) for wrap, ckpt in RUNS]
    ddp = {r["checkpointing"]: r["static"] for r in runs if r["wrap"] == "ddp"}
    for r in runs:
        r["static_vs_ddp"] = r["static"] / ddp[r["checkpointing"]]
    if dist.get_rank() == 0:
        write_json({"model": args.model, "method": args.method, "processes": dist.get_world_size(),
                    "meta": args.meta, "batch_size": args.batch_size, "prompt": args.prompt, "answer": args.answer,
                    "threads": torch.get_num_threads(), "runs": runs}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
