"""Sharded training (FSDP2) on 2 gloo processes: the weights of 1 process with the global batch (LoRA and full
fine-tuning, clipping all or only the adapters), activation checkpointing on equals off under FSDP and DDP, an
exact resume, checkpoints in the standard format; a model that cannot be sharded and a run that cannot shard
get one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bitune import BituneModel
from bitune.errors import BituneError
from bitune.train.run_folder import LOG_FILE, checkpoints
from bitune.train.sharding import fsdp_options, shard
from helpers.compare import assert_same_weights, trainable
from helpers.dist import check, final_weights, torchrun, train_global_batch, train_tiny
from helpers.models import tiny_bitune, tiny_model

LIMIT = 0.01
CLIP = ("--max-grad-norm", str(LIMIT))  # below the gradient norms of these runs: clipping acts at every step


def one_process_run(root: Path, **kwargs) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Weights and logged grad norms after 4 steps of 1 process with batch 4 x accumulation 2 (global batch 8)."""
    trainer = train_global_batch(root / "run", **kwargs)
    return trainable(trainer.model), grad_norms(root / "run")


def grad_norms(run: Path) -> list[float]:
    return [r["grad_norm"] for r in map(json.loads, (run / LOG_FILE).read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def sharded_lora(tmp_path_factory) -> Path:
    """2 processes x batch 2 x accumulation 2, FSDP2, LoRA, a checkpoint every 2 steps."""
    run = tmp_path_factory.mktemp("fsdp") / "run"
    check(torchrun(2, "train", "--out", str(run), "--fsdp", "--steps", "4", "--save-every", "2", *CLIP))
    return run


@pytest.mark.slow
def test_fsdp_lora_matches_one_process(sharded_lora, tmp_path):
    """The weights and the (global, pre-clip) gradient norms of each step equal 1 process's: the norm is taken
    over the sharded gradients of both processes, not over one shard. Checkpoints are the standard format."""
    weights, norms = one_process_run(tmp_path, max_grad_norm=LIMIT)
    assert_same_weights(final_weights(sharded_lora), weights, atol=1e-5)
    assert grad_norms(sharded_lora) == pytest.approx(norms, rel=1e-5)
    assert min(norms) > LIMIT  # clipping was active at every step
    assert [p.name for p in checkpoints(sharded_lora)] == ["checkpoint-2", "checkpoint-4"]
    BituneModel.from_pretrained(sharded_lora / "checkpoint-2", base=tiny_model())  # loads like any checkpoint


@pytest.mark.slow
def test_fsdp_full_with_checkpointing_and_adapter_clipping_matches_one_process(tmp_path):
    """method full (two whole weight copies, the sequential path), activation checkpointing on under FSDP, clip
    only the adapters: the weights of 1 process without checkpointing."""
    run = tmp_path / "run"
    check(torchrun(2, "train", "--out", str(run), "--fsdp", "--method", "full", "--checkpointing",
                   "--clip", "adapters", "--steps", "4", *CLIP))
    weights, norms = one_process_run(tmp_path / "one", method="full", clip="adapters", max_grad_norm=LIMIT)
    assert_same_weights(final_weights(run), weights, atol=1e-5)
    assert grad_norms(run) == pytest.approx(norms, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dora", "ia3"])
def test_fsdp_unroutable_peft_methods_match_one_process(tmp_path, method):
    """DoRA and IA3 switch PEFT's active adapter for the bidir pass (the sequential path) inside sharded layers."""
    run = tmp_path / "run"
    check(torchrun(2, "train", "--out", str(run), "--fsdp", "--method", method, "--steps", "4", *CLIP))
    weights, _ = one_process_run(tmp_path / "one", method=method, max_grad_norm=LIMIT)
    assert_same_weights(final_weights(run), weights, atol=1e-5)


@pytest.mark.slow
def test_ddp_with_checkpointing_matches_one_process(tmp_path):
    run = tmp_path / "run"
    check(torchrun(2, "train", "--out", str(run), "--checkpointing", "--steps", "4"))
    weights, _ = one_process_run(tmp_path / "one")
    assert_same_weights(final_weights(run), weights, atol=1e-5)


@pytest.mark.slow
def test_fsdp_resume_is_exact(sharded_lora, tmp_path):
    """Interrupted after step 3, resumed from checkpoint-2: bit for bit the uninterrupted sharded run."""
    run = tmp_path / "run"
    job = torchrun(2, "train", "--out", str(run), "--fsdp", "--steps", "4", "--save-every", "2",
                   "--interrupt-at", "3", *CLIP)
    assert job.returncode != 0 and [p.name for p in checkpoints(run)] == ["checkpoint-2"]
    check(torchrun(2, "train", "--out", str(run), "--fsdp", "--steps", "4", "--save-every", "2", "--resume", *CLIP))
    assert_same_weights(final_weights(run), final_weights(sharded_lora), atol=0)
    assert grad_norms(run) == grad_norms(sharded_lora)


def test_a_model_without_decoder_layers_cannot_shard():
    model = tiny_bitune()
    model.weights.base._no_split_modules = None  # a model class that names no decoder layer class
    with pytest.raises(BituneError, match="fsdp: cannot shard this model: .*no list of 2 decoder layers"):
        shard(model, bf16=False)


def test_fsdp_needs_several_processes(tmp_path):
    with pytest.raises(BituneError, match="fsdp shards over several processes"):
        train_tiny(str(tmp_path / "run"), fsdp=True)


def test_accelerate_fsdp_config_turns_sharding_on(monkeypatch):
    """What ``accelerate launch --config_file configs/accelerate/fsdp.yaml`` puts in the environment."""
    assert not fsdp_options(False).shard
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    options = fsdp_options(False)
    assert options.shard and options.reshard_after_forward is False and options.checkpointing
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(BituneError, match="fsdp_version: 2"):
        fsdp_options(False)


def test_cli_fsdp_in_one_process_fails_before_loading(tmp_path, capsys, monkeypatch):
    from bitune.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--fsdp", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    assert "fsdp shards over several processes" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
