"""Data-parallel training: 2 gloo processes on CPU give the update of 1 process with the global batch, every
trainable parameter of every variant gets a gradient (DDP runs with find_unused_parameters=False), logs and
checkpoints are written once, resume works multi-process, the launcher and accelerate configs are sound.

Each ``torchrun`` job starts two Python processes (about 10-25 s on a 2-core machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bitune.config import METHODS, VARIANTS
from bitune.errors import BituneError
from bitune.train.run_folder import LOG_FILE, checkpoints
from bitune.train.trainer import ddp_kwargs
from helpers.compare import assert_same_weights, trainable
from helpers.dist import check, final_weights, torchrun, train_global_batch, train_tiny
from helpers.models import batch, tiny_bitune, tiny_model

TRAINABLE = [v for v in VARIANTS if v != "pretrained"]
ACCELERATE_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "accelerate"


@pytest.fixture(scope="module")
def one_process_weights(tmp_path_factory) -> dict[str, torch.Tensor]:
    """Weights after 4 steps of 1 process with batch 4 x accumulation 2 (global batch 8)."""
    torch.set_num_threads(1)
    return trainable(train_global_batch(tmp_path_factory.mktemp("one") / "run").model)


# ------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("variant", TRAINABLE)
def test_every_trainable_parameter_gets_a_gradient(variant, method):
    """What DDP with find_unused_parameters=False needs: the parameters that require a gradient are exactly the
    model's trainable parameters, and the training loss reaches every one of them."""
    model = tiny_bitune(variant=variant, method=method).train()
    out = model(*batch())
    out.example_loss.mean().backward()
    trainable = {id(p) for p in model.trainable_parameters().values()}
    assert {id(p) for p in model.parameters() if p.requires_grad} == trainable
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


def test_ddp_is_told_there_are_no_unused_parameters():
    assert ddp_kwargs().find_unused_parameters is False


@pytest.mark.slow
def test_every_variant_trains_under_two_gloo_processes(tmp_path):
    """Two optimizer steps each: an unused parameter would stop DDP at the second step."""
    specs = [f"{v}:lora" for v in TRAINABLE] + ["bitune:dora", "bitune:ia3", "bitune:full", "lora:full"]
    check(torchrun(2, "variants", "--out", str(tmp_path), "--variants", ",".join(specs)))
    assert json.loads((tmp_path / "done.json").read_text()) == {s: 2 for s in specs}


# ------------------------------------------------------------------------------------------- equivalence
def test_loss_is_the_example_mean(tmp_path):
    """The trainer's loss weighs every example the same, whatever its answer length."""
    trainer = train_tiny(str(tmp_path / "run"), steps=1)
    model = trainer.model.eval()
    tensors = batch(prompt_lens=(6, 4, 5), answer_lens=(1, 4, 2))
    inputs = dict(zip(("prompt_ids", "prompt_mask", "answer_ids", "answer_mask"), tensors))
    with torch.no_grad():
        loss = trainer.batch_loss(model, inputs)
        out = model(*tensors)
    per_example = [model(*(t[i:i + 1] for t in tensors)).loss for i in range(3)]
    torch.testing.assert_close(loss, torch.stack(per_example).mean(), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.loss, loss, rtol=0, atol=1e-6)  # BituneOutput.loss is what train optimises
    token_mean = -out.token_logprobs.sum() / inputs["answer_mask"].sum()
    assert abs(loss - token_mean) > 1e-4  # and differs from the token mean on these mixed lengths


@pytest.mark.slow
def test_two_processes_match_one_process_with_the_global_batch(tmp_path, one_process_weights):
    """2 processes x batch 2 x accumulation 2 == 1 process x batch 4 x accumulation 2, to 1e-5, although the
    ranks hold different answer-token counts; logs, checkpoints and final/ are written once."""
    run = tmp_path / "run"
    check(torchrun(2, "train", "--out", str(run), "--batch-size", "2", "--steps", "4", "--save-every", "2"))
    assert_same_weights(final_weights(run), one_process_weights, atol=1e-5)
    steps = [r["step"] for r in map(json.loads, (run / LOG_FILE).read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]
    assert [p.name for p in checkpoints(run)] == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in (run / "checkpoint-4").glob("rng_state*")) == ["rng_state_0.pth",
                                                                                  "rng_state_1.pth"]
    assert not [p for p in run.iterdir() if p.name.startswith(".")]  # no staging leftovers
    assert len(list((run / "tensorboard").iterdir())) == 1  # one writer


@pytest.mark.slow
def test_two_process_resume_matches_uninterrupted_run(tmp_path, one_process_weights):
    run = tmp_path / "run"
    job = torchrun(2, "train", "--out", str(run), "--steps", "4", "--save-every", "2", "--interrupt-at", "3")
    assert job.returncode != 0
    assert [p.name for p in checkpoints(run)] == ["checkpoint-2"] and not (run / "final").exists()
    settings_before = (run / "settings.yaml").read_text()
    with pytest.raises(BituneError, match="written by 2 process"):
        train_tiny(str(run), steps=4, save_every=2, resume=True)  # 1 process: another global batch
    assert (run / "settings.yaml").read_text() == settings_before
    check(torchrun(2, "train", "--out", str(run), "--steps", "4", "--save-every", "2", "--resume"))
    assert_same_weights(final_weights(run), one_process_weights, atol=1e-5)
    steps = [r["step"] for r in map(json.loads, (run / LOG_FILE).read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------- launching
@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True])
def test_cli_num_processes_trains_data_parallel(tmp_path, fsdp):
    """``bitune train --num-processes 2 [--fsdp]`` on a local tiny model and a JSONL file, end to end."""
    from helpers.tokenizer import tiny_tokenizer

    base = tmp_path / "base"
    tiny_model().save_pretrained(base)
    tiny_tokenizer().save_pretrained(base)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"say {w}", "output": w}) + "\n"
                            for w in ["yes", "no", "maybe", "so", "ok", "fine", "good", "bad"]))
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bitune.cli", "train", "--num-processes", "2", "--set", f"model={base}",
           "--set", f"dataset={data}", "--set", f"output_dir={out}", "--set", "steps=2", "--set", "batch_size=2",
           "--set", "grad_accum=1", "--set", "log_every=1", "--set", "max_length=64"] + (["--fsdp"] if fsdp else [])
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    check(job)
    assert job.stdout.count("bitune train: final model in") == 1  # one process reports
    assert (out / "final" / "bitune_config.json").is_file()
    records = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert records[0]["event"] == "data" and records[0]["train_examples"] == 8
    assert f"fsdp: {str(fsdp).lower()}" in (out / "settings.yaml").read_text()


def test_num_processes_is_refused_inside_a_launched_job(monkeypatch):
    from bitune.commands.train import launch

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(BituneError, match="already running"):
        launch(2, ["train"])


def test_launch_args_rerun_the_same_arguments():
    from bitune.cli import build_parser
    from bitune.commands.launcher import launch_args
    from bitune.commands.train import train_argv

    argv = ["train", "--config", "a.yaml", "--set", "lr=1e-3", "--num-processes", "4", "--resume"]
    sys_argv = sys.argv
    try:
        sys.argv = ["bitune", *argv]
        args = build_parser().parse_args(argv)
    finally:
        sys.argv = sys_argv
    cmd = launch_args(args.num_processes, train_argv(args), "/tmp/logs")
    assert cmd == ["--standalone", "--nproc_per_node=4", "--log-dir", "/tmp/logs", "--redirects", "1:3,2:3,3:3",
                   "-m", "bitune.cli", "train", "--config", "a.yaml", "--set", "lr=1e-3", "--resume"]


def _rank_log(logs, rank, text):
    folder = logs / "run-id" / "attempt_0" / str(rank)
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text(text)


def test_a_launched_user_error_is_shown_once(tmp_path, capsys):
    """Every rank hits the same bad setting: rank 0 prints it (live), the others' copies stay in their logs; when
    rank 0 was only stopped by the launcher, the others' error is shown, once; a crash shows the end of its output."""
    from bitune.commands.launcher import report_failure

    line = "bitune train: error: model folder ./nope does not exist"
    for rank in (1, 2):
        _rank_log(tmp_path, rank, f"loading\n{line}\n")
        (tmp_path / f"error-{rank}.txt").write_text(line + "\n")  # what bitune.cli.report_error leaves
    assert report_failure({0: -15, 1: 2, 2: 2}, tmp_path) == 2  # rank 0 stopped (SIGTERM) before it printed
    assert capsys.readouterr().err == line + "\n"
    (tmp_path / "error-0.txt").write_text(line + "\n")  # rank 0 printed it (then was stopped, or exited 2)
    for rank0 in (2, -15):
        assert report_failure({0: rank0, 1: 2, 2: 2}, tmp_path) == 2
        assert capsys.readouterr().err == ""
    _rank_log(tmp_path, 3, "Traceback (most recent call last):\nRuntimeError: boom\n")
    assert report_failure({0: -15, 3: 1}, tmp_path) == 1
    err = capsys.readouterr().err
    assert "process 3 failed (exit status 1)" in err and "RuntimeError: boom" in err


@pytest.mark.slow
def test_cli_num_processes_user_error_is_one_line_exit_2(tmp_path):
    """A bad setting that only the launched processes find: one error line, exit status 2, no launcher traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    (tmp_path / "empty").mkdir()  # a folder, as a model must be (checked before the launch), but no model in it
    cmd = [sys.executable, "-m", "bitune.cli", "train", "--num-processes", "2", "--set", f"model={tmp_path}/empty",
           "--set", f"output_dir={tmp_path / 'run'}", "--set", "steps=1"]
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert job.returncode == 2, job.stderr
    lines = [x for x in job.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("bitune train: error: cannot load model") and "empty" in lines[0], \
        job.stderr


@pytest.mark.parametrize("name, kind", [("ddp", "MULTI_GPU"), ("fsdp", "FSDP")])
def test_accelerate_configs_parse(name, kind):
    """accelerate's own loader and launcher read the example configs into the intended environment."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import prepare_multi_gpu_env

    path = ACCELERATE_CONFIGS / f"{name}.yaml"
    assert str(load_config_from_file(str(path)).distributed_type) == f"DistributedType.{kind}"
    args = launch_command_parser().parse_args(["--config_file", str(path), "-m", "bitune.cli", "train"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert args.num_processes == 2
    if name == "fsdp":
        assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
        assert env["FSDP_RESHARD_AFTER_FORWARD"] == "true" and env["FSDP_OFFLOAD_PARAMS"] == "false"
    else:
        assert args.multi_gpu and "ACCELERATE_USE_FSDP" not in env


@pytest.mark.parametrize("value, expected", [(None, 1), ("1", 1), ("4", 4), ("0", None), ("x", None), ("-2", None)])
def test_world_size_reads_the_launchers_variable(monkeypatch, value, expected):
    from bitune.processes import world_size

    if value is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", value)
    if expected is None:
        with pytest.raises(BituneError, match="WORLD_SIZE"):
            world_size()
    else:
        assert world_size() == expected
