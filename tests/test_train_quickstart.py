"""Quickstart scoring on a tiny model, and a real-model training run (integration)."""

from __future__ import annotations

import json

import pytest

from bitune import BituneModel


def _rows(right: dict[str, int]) -> dict[str, dict]:
    """Quickstart rows of 100 questions where each model answers its first ``right[model]`` correctly, with their
    statistics (:func:`bitune.commands.quickstart.add_statistics`)."""
    import numpy as np

    from bitune.commands.quickstart import add_statistics

    correct = {v: np.r_[np.ones(k), np.zeros(100 - k)] for v, k in right.items()}
    rows = {v: {"acc": c.mean(), "acc_norm": c.mean(), "n": 100, "train_s": 1.0, "eval_s": 1.0}
            for v, c in correct.items()}
    add_statistics(rows, correct)
    return rows


def test_quickstart_table_has_intervals_and_paired_differences_to_lora(capsys):
    from bitune.commands.quickstart import print_table

    rows = _rows({"pretrained": 30, "lora": 40, "bitune": 50})
    assert "vs_lora" not in rows["lora"]
    assert rows["bitune"]["vs_lora"]["diff"] == pytest.approx(0.10)
    assert (rows["bitune"]["vs_lora"]["only_this_right"], rows["bitune"]["vs_lora"]["only_lora_right"]) == (10, 0)
    lo, hi = rows["bitune"]["vs_lora"]["ci"]
    assert 0 < lo < 0.10 < hi
    assert rows["pretrained"]["vs_lora"]["diff"] == pytest.approx(-0.10)
    print_table({"model": "m", "task": "arc_easy", "eval_examples": 100, "steps": 30, "batch_size": 4, "seed": 42,
                 "results": rows, "threads": 2, "total_s": 60})
    out = capsys.readouterr().out
    assert "smoke test" in out and "docs/results.md" in out and "+10.0 [" in out and "40.0 [" in out


def test_quickstart_table_has_each_trained_models_difference_to_pretrained(capsys):
    """The main job's question: does fine-tuning lift the task? Each trained model against the pretrained one."""
    from bitune.commands.quickstart import print_table

    rows = _rows({"pretrained": 30, "lora": 42, "bitune": 45})
    assert "vs_pretrained" not in rows["pretrained"]
    for variant, diff, only in (("lora", 0.12, 12), ("bitune", 0.15, 15)):
        vs = rows[variant]["vs_pretrained"]
        assert vs["diff"] == pytest.approx(diff)
        assert (vs["only_this_right"], vs["only_pretrained_right"]) == (only, 0) and vs["mcnemar_p"] < 0.001
        assert 0 < vs["ci"][0] < diff < vs["ci"][1]
    print_table({"model": "m", "task": "arc_easy", "eval_examples": 100, "steps": 80, "batch_size": 4, "lr": 3e-3,
                 "seed": 42, "results": rows, "threads": 2, "total_s": 60})
    out = capsys.readouterr().out
    assert "Δ vs pretrained" in out and "+12.0 [" in out and "+15.0 [" in out and "lr 0.003" in out
    assert "one seed, 80 steps x batch 4" in out


def test_quickstart_defaults_train_each_question_once(monkeypatch, tmp_path):
    """The default run trains steps x batch distinct questions; --train-examples still overrides it."""
    from bitune.cli import main
    from bitune.commands import quickstart as qs

    calls = []
    monkeypatch.setattr(qs, "quickstart", lambda out, **kw: calls.append(kw) or {})
    monkeypatch.setattr(qs, "print_table", lambda result: None)
    assert main(["quickstart", "--output-dir", str(tmp_path / "a")]) == 0
    assert calls[-1] == {"steps": qs.STEPS, "train_examples": qs.STEPS * qs.BATCH_SIZE,
                         "eval_examples": qs.EVAL_EXAMPLES, "batch_size": qs.BATCH_SIZE, "lr": qs.LR, "seed": 42}
    assert main(["quickstart", "--output-dir", str(tmp_path / "b"), "--steps", "5", "--batch-size", "2"]) == 0
    assert calls[-1]["train_examples"] == 10
    assert main(["quickstart", "--output-dir", str(tmp_path / "c"), "--train-examples", "7"]) == 0
    assert calls[-1]["train_examples"] == 7


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
