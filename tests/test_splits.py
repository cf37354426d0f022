"""Tuning splits, never the reported one (study part 4): the ``dev`` draw from CSQA/PIQA/SIQA's training questions,
``bitune eval --split`` and what the records and reports make of it; and the Bitune start share ``init_share``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bitune.cli import main
from bitune.commands.sweep import check_done
from bitune.config import PAPER_INIT_SHARE, BituneConfig
from bitune.data import sources
from bitune.data.datasets import DATASETS, DEV_SIZE, load_examples, resolve_split
from bitune.errors import BituneError
from bitune.eval.tasks import make_task, task_split
from bitune.mixer import Mixer
from bitune.model import BituneModel
from bitune.records import record_splits
from helpers.models import tiny_bitune, tiny_model
from test_eval_report import paired_record, write_runs

ROOT = Path(__file__).resolve().parent.parent


def _csqa_docs(n):
    return [{"id": f"q{i}", "query": f"Question: q{i}?\nAnswer:", "choices": ["a", "b"], "gold": i % 2}
            for i in range(n)]


def test_dev_is_a_fixed_draw_of_training_questions_that_train_no_dev_leaves_out(monkeypatch):
    monkeypatch.setattr(sources, "olmo_task_docs", lambda task, split: _csqa_docs(1200 if split == "train" else 7))
    train, dev, rest = (load_examples("csqa", s) for s in ("train", "dev", "train_no_dev"))
    ids = [e.id for e in train]
    assert len(dev) == DEV_SIZE and len(rest) == len(train) - DEV_SIZE
    assert {e.id for e in dev}.isdisjoint(e.id for e in rest)
    assert sorted(e.id for e in dev + rest) == sorted(ids)
    assert [e.id for e in rest] == [i for i in ids if i in {e.id for e in rest}]  # training order kept
    assert [e.id for e in load_examples("csqa", "dev")] == [e.id for e in dev]  # the same draw every time
    assert [e.id for e in dev] != ids[:DEV_SIZE]  # drawn, not the first questions


def test_every_benchmark_tunes_on_a_split_other_than_the_one_it_reports():
    for name, info in DATASETS.items():
        if info.eval_split is None:
            continue
        if info.dev_split is not None:
            assert info.dev_split != info.eval_split and info.dev_split in info.splits
            assert resolve_split(name, "tuning") == info.dev_split
        assert resolve_split(name, None) == resolve_split(name, "reported") == info.eval_split
    assert resolve_split("arc_easy", "tuning") == "validation" and resolve_split("csqa", "tuning") == "dev"
    assert resolve_split("mmlu", "dev") == "dev"  # a split name is taken as it is
    with pytest.raises(BituneError, match="gsm8k has no tuning split"):
        resolve_split("gsm8k", "tuning")
    with pytest.raises(BituneError, match="no split 'tset'.*reported, tuning"):
        resolve_split("arc_easy", "tset")


def test_a_task_reads_the_split_it_is_given(monkeypatch):
    monkeypatch.setattr(sources, "olmo_task_docs", lambda task, split: [
        {"id": f"{split}{i}", "query": f"Question: {split} {i}?\nAnswer:", "choices": ["a", "b"], "gold": 0}
        for i in range({"train": 4, "validation": 3, "test": 5}[split])])
    reported, tuning = make_task("arc_easy"), make_task("arc_easy", "tuning")
    assert (task_split(reported), task_split(tuning)) == ("test", "validation")
    assert [d["id"] for d in reported.test_docs()] == [f"test{i}" for i in range(5)]
    assert [d["id"] for d in tuning.test_docs()] == [f"validation{i}" for i in range(3)]


def test_records_without_splits_were_made_on_the_reported_split():
    record = paired_record("lora", 42, [1, 0])
    assert record_splits(record) == {"arc_challenge": "test"}
    record["config"]["splits"] = {"arc_challenge": "validation"}
    assert record_splits(record) == {"arc_challenge": "validation"}


def test_report_refuses_to_pool_a_tuning_split_with_the_reported_one(tmp_path, capsys):
    records = [paired_record("lora", 42, [1, 0] * 10), paired_record("bitune", 42, [1, 1] * 10)]
    records[1]["config"]["splits"] = {"arc_challenge": "validation"}
    write_runs(tmp_path / "r", records)
    assert main(["report", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "task arc_challenge" in err and "validation split" in err and "on test" in err


def test_sweep_does_not_take_an_evaluation_of_another_split_as_done(tmp_path):
    result = tmp_path / "eval.json"
    assert not check_done(result, {"arc_challenge": "test"}, None)
    result.write_text(json.dumps(paired_record("lora", 42, [1, 0])))
    assert check_done(result, {"arc_challenge": "test"}, None)
    with pytest.raises(BituneError, match=r"arc_challenge \(test\).*asks for arc_challenge \(validation\)"):
        check_done(result, {"arc_challenge": "validation"}, None)


@pytest.mark.parametrize("share", [0.5, 0.1, 0.01, 0.9])
def test_init_share_is_every_mixing_ratio_at_the_start(share):
    mixer = Mixer(num_layers=3, theta_init=0.01, init_share=share)
    for ratios in mixer.ratios().values():
        assert ratios.tolist() == pytest.approx([share] * 3, rel=1e-6)
    if share == 0.5:  # the paper's start: theta = theta_init exactly
        assert torch.equal(mixer.theta_k, torch.full((3,), 0.01)) and mixer.ratios()["v"].tolist() == [0.5] * 3


@pytest.mark.parametrize("share", [0.0, 1.0, -0.1, float("nan")])
def test_init_share_outside_the_open_interval_is_refused(share):
    with pytest.raises(ValueError, match="init_share"):
        BituneConfig(init_share=share)


def test_a_model_started_near_causal_keeps_its_config_and_its_learnt_thetas(tmp_path):
    model = tiny_bitune(init_share=0.1)
    assert model.mixing_ratios()["k"].tolist() == pytest.approx([0.1, 0.1], rel=1e-6)
    with torch.no_grad():
        model.mixer.theta_k[0] = 0.03  # as if trained: a_k = 0.75 in layer 0
    model.save_pretrained(tmp_path / "ckpt")
    loaded = BituneModel.from_pretrained(tmp_path / "ckpt", base=tiny_model("llama"), merge=False)
    assert loaded.config.init_share == 0.1
    assert loaded.mixing_ratios()["k"].tolist() == pytest.approx([0.75, 0.1], rel=1e-6)  # the saved thetas, not init


def test_the_default_start_is_near_causal_and_the_paper_configs_pin_its_half():
    """A user's run starts near causal (a short run does not begin half on untrained bidirectional features); the
    paper's configs and every study config whose variant mixes start at the paper's 0.5, so reproductions and the
    committed studies are unchanged; the start-share candidates of part 4 keep their own."""
    from bitune.train.settings import load_settings

    assert BituneConfig().init_share == 0.1 and PAPER_INIT_SHARE == 0.5
    configs = ROOT / "configs"
    files = [*sorted((configs / "tasks").glob("*.yaml")), *sorted((configs / "study").rglob("*.yaml")),
             *sorted((configs / "methods").glob("*.yaml")), configs / "instruct" / "ultrafeedback.yaml"]
    checked = 0
    for path in files:
        settings = load_settings(path)
        if not settings.bitune.mixes or path.stem.startswith("bitune_share"):
            continue
        assert settings.bitune.init_share == PAPER_INIT_SHARE, f"{path.relative_to(ROOT)} starts elsewhere"
        checked += 1
    assert checked >= 20
    for demo in ("chat_demo", "alpaca_demo"):  # the walk-through's short runs take the user default
        assert load_settings(configs / "instruct" / f"{demo}.yaml").bitune.init_share == 0.1


def test_a_checkpoint_that_does_not_record_its_start_share_started_at_the_papers(tmp_path):
    from bitune.config import CONFIG_FILE, read_config

    model = tiny_bitune()
    model.save_pretrained(tmp_path / "ckpt")
    path = tmp_path / "ckpt" / CONFIG_FILE
    data = json.loads(path.read_text())
    assert data["init_share"] == 0.1
    del data["init_share"]  # as a checkpoint saved before the setting existed
    path.write_text(json.dumps(data))
    assert read_config(tmp_path / "ckpt").init_share == 0.5
    assert BituneModel.from_pretrained(tmp_path / "ckpt", base=tiny_model("llama")).config.init_share == 0.5


@pytest.mark.parametrize("share", [1e-300, 1e-37])
def test_a_start_share_whose_theta_underflows_float32_is_refused_in_one_line(share):
    """theta = theta_init * a / (1 - a) at 1e-300 is 0 in float32, where |theta| has no gradient: the share
    would stay 0 for the whole run without a word."""
    assert float(torch.tensor(0.01 * share / (1 - share), dtype=torch.float32)) < torch.finfo(torch.float32).tiny
    with pytest.raises(ValueError, match=r"init_share=1e-3\d+ is too small.*float32.*use a share in \[1e-36, "):
        BituneConfig(init_share=share)
    assert BituneConfig(init_share=1e-30).init_share == 1e-30  # small but representable: accepted


def test_set_init_share_that_underflows_is_one_line_naming_the_key(tmp_path, capsys):
    code = main(["train", "--set", "model=tiny", "--set", "dataset=tiny", "--set", "bitune.init_share=1e-300",
                 "--set", f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "init_share" in err[0] and "too small" in err[0], err
    assert not (tmp_path / "run").exists()
