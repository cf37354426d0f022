"""Quickstart scoring on a tiny model, and a real-model training run (integration)."""

from __future__ import annotations

import json

import pytest

from bitune import BituneModel


def test_quickstart_table_has_intervals_and_paired_differences_to_lora(capsys):
    import numpy as np

    from bitune.commands.quickstart import add_statistics, print_table

    correct = {"pretrained": np.r_[np.ones(30), np.zeros(70)], "lora": np.r_[np.ones(40), np.zeros(60)],
               "bitune": np.r_[np.ones(50), np.zeros(50)]}
    rows = {v: {"acc": c.mean(), "acc_norm": c.mean(), "n": 100, "train_s": 1.0, "eval_s": 1.0}
            for v, c in correct.items()}
    add_statistics(rows, correct)
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
