"""The run folder is never lost: one trainer at a time (lock), nothing to resume is an error, a finished run is
kept, a diverged run writes no NaN weights, and a resumed run reports the loss over all its steps."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bitune.cli import main
from bitune.errors import BituneError
from bitune.train.run_folder import LOG_FILE, checkpoints, run_lock
from bitune.train.trainer import run_training
from helpers.dist import Interrupt
from helpers.gen import save_checkpoint
from helpers.train import make_trainer, read_log


def digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


class Second:
    """At optimizer step ``at`` of the first trainer, run ``bitune train`` on the same folder in a new process."""

    def __init__(self, at: int, argvs: list[list[str]]):
        self.at, self.argvs, self.results = at, argvs, []

    def __call__(self, step, model):
        if step == self.at:
            for argv in self.argvs:
                self.results.append(subprocess.run([sys.executable, "-m", "bitune.cli", *argv], capture_output=True,
                                                   text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}))


def test_second_trainer_on_the_same_folder_is_refused_and_the_first_loses_nothing(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    config = tmp_path / "run.yaml"
    second = Second(at=3, argvs=[["train", "--config", str(config), "--resume"],
                                 ["train", "--config", str(config), "--overwrite"]])
    trainer, settings = make_trainer(tmp_path, callbacks=[second], dataset=str(data), steps=6, save_every=2,
                                     save_total_limit=None)
    config.write_text(settings.to_yaml())
    run_training(trainer, settings)
    for done in second.results:
        assert done.returncode == 2, done.stderr
        err = done.stderr.strip().splitlines()
        assert len(err) == 1 and "in use by another bitune train" in err[0] and f"pid {os.getpid()}" in err[0], err
    run_dir = tmp_path / "run"
    assert [r["step"] for r in read_log(run_dir) if "loss" in r] == [1, 2, 3, 4, 5, 6]  # one run, not two
    assert [p.name for p in checkpoints(run_dir)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert (run_dir / "final" / "bitune_config.json").is_file()


def test_lock_of_a_killed_process_is_not_stale(tmp_path):
    code = ("import sys, time\nfrom bitune.train.run_folder import run_lock\nheld = run_lock(sys.argv[1])\nheld.__enter__()\n"
            "print('locked', flush=True)\ntime.sleep(120)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(BituneError, match=f"pid {holder.pid}"):
            with run_lock(tmp_path):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run_lock(tmp_path):  # the OS dropped the dead process's lock
        pass


@pytest.mark.parametrize("save_every", [None, 2])
def test_resume_on_a_finished_run_leaves_it_bit_identical(tmp_path, save_every):
    trainer, settings = make_trainer(tmp_path, steps=4, save_every=save_every)
    run_training(trainer, settings)
    run_dir = tmp_path / "run"
    before = digest(run_dir)
    again, settings = make_trainer(tmp_path, steps=4, save_every=save_every)
    with pytest.raises(BituneError, match="finished run .*final/.*--overwrite"):
        run_training(again, settings, resume=True)
    assert digest(run_dir) == before


def test_resume_with_nothing_to_resume_names_what_is_there(tmp_path):
    trainer, settings = make_trainer(tmp_path, steps=4)
    with pytest.raises(BituneError, match="does not exist|holds: nothing"):
        run_training(trainer, settings, resume=True)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint-3").mkdir(parents=True)  # empty: not a checkpoint
    (run_dir / LOG_FILE).write_text('{"step": 0}\n')
    trainer, settings = make_trainer(tmp_path, steps=4)
    with pytest.raises(BituneError, match=r"no complete checkpoint .*checkpoint-3/ \(incomplete\).*log.jsonl"):
        run_training(trainer, settings, resume=True)
    assert (run_dir / LOG_FILE).read_text() == '{"step": 0}\n'
    trainer, settings = make_trainer(tmp_path, steps=2)
    run_training(trainer, settings, overwrite=True)  # the explicit flag starts afresh
    assert not (run_dir / "checkpoint-3").exists() and [r["step"] for r in read_log(run_dir)] == [1, 2, 2]


class Poison:
    """Write NaN into one trained tensor at the end of step ``at``, after hashing the run's checkpoints."""

    def __init__(self, at: int, run_dir: Path):
        self.at, self.run_dir, self.before = at, run_dir, None

    def __call__(self, step, model):
        if step == self.at:
            self.before = digest(self.run_dir) if self.run_dir.exists() else {}
            with torch.no_grad():
                next(iter(model.trainable_parameters().values())).fill_(float("nan"))


@pytest.mark.parametrize("at", [2, 3])
def test_non_finite_loss_or_weights_stop_training_and_keep_the_last_good_checkpoint(tmp_path, at):
    run_dir = tmp_path / "run"
    poison = Poison(at, run_dir)
    trainer, settings = make_trainer(tmp_path, steps=6, save_every=2, save_total_limit=None, callbacks=[poison])
    with pytest.raises(BituneError, match="diverged") as e:
        run_training(trainer, settings)
    assert not (run_dir / "final").exists()
    if at == 2:  # NaN weights at a save step: the checkpoint is refused
        assert "inf/NaN" in str(e.value) and not checkpoints(run_dir)
    else:  # the next step's loss is NaN: stopped before checkpoint-4, checkpoint-2 untouched
        assert "loss is nan" in str(e.value) and "checkpoint-2" in str(e.value)
        assert [p.name for p in checkpoints(run_dir)] == ["checkpoint-2"]
        after = digest(run_dir)
        assert {k: v for k, v in after.items() if k.startswith("checkpoint-2/")} == \
            {k: v for k, v in poison.before.items() if k.startswith("checkpoint-2/")}


def test_resumed_run_reports_the_loss_over_all_its_steps(tmp_path):
    opts = dict(steps=6, save_every=3, log_every=4, save_total_limit=None)
    full, settings = make_trainer(tmp_path / "a", **opts)
    expected = run_training(full, settings).metrics["train_loss"]
    first, settings = make_trainer(tmp_path / "b", callbacks=[Interrupt(at=5)], **opts)
    with pytest.raises(KeyboardInterrupt):
        run_training(first, settings)
    second, settings = make_trainer(tmp_path / "b", **opts)
    got = run_training(second, settings, resume=True).metrics["train_loss"]
    assert got == pytest.approx(expected, rel=1e-6)
    summary = [r for r in read_log(tmp_path / "b" / "run") if "train_loss" in r]
    assert len(summary) == 1 and summary[0]["train_loss"] == pytest.approx(expected, rel=1e-6)
    # the checkpoint step is logged, though log_every is 4; the lines after it were replaced, not duplicated
    assert [r["step"] for r in read_log(tmp_path / "b" / "run") if "loss" in r] == [3, 4, 6]


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory):
    """A tiny base model + tokenizer (no chat template) on disk, as ``bitune train`` loads a local model."""
    root = tmp_path_factory.mktemp("start")
    save_checkpoint(root)
    return root / "base"


@pytest.mark.parametrize("case", ["unknown_model", "no_example_fits", "chat_data_without_template",
                                  "max_length_past_positions"])
@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_start_leaves_nothing_it_created(tmp_path, base_folder, capsys, case, existing):
    data = tmp_path / "data.jsonl"
    data.write_text('{"instruction": "say hi", "output": "hi there"}\n' if case != "chat_data_without_template" else
                    '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ho"}]}\n')
    opts = {"model": str(base_folder), "dataset": str(data), "max_length": 64, "steps": 1}
    opts.update({"unknown_model": {"model": str(tmp_path / "no-such-model")}, "no_example_fits": {"max_length": 4},
                 "max_length_past_positions": {"max_length": 1000}}.get(case, {}))
    out = tmp_path / "runs" / "a" / "run"  # two parent folders made by the start, removed with it
    if existing:
        out.mkdir(parents=True)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**opts, "output_dir": str(out)}))
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # progress bars of the model loading, then the error
    assert err[-1].startswith("bitune train: error:") and sum("error" in line for line in err) == 1, err
    if existing:
        assert out.is_dir() and not any(out.iterdir())  # the folder was there: kept, and left empty
    else:
        assert not (tmp_path / "runs").exists()
    opts.update(model=str(base_folder), max_length=64, dataset=str(data))
    if case == "chat_data_without_template":
        data.write_text('{"instruction": "say hi", "output": "hi there"}\n')
    config.write_text(yaml.safe_dump({**opts, "output_dir": str(out)}))
    assert main(["train", "--config", str(config)]) == 0  # the folder takes a run as if nothing had happened
    assert (out / "final" / "bitune_config.json").is_file()
