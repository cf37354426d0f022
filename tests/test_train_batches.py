"""Length-grouped batches (less padding, same order in every process and after a resume) and gradient clipping
per parameter group, with the adapters' and the mixer's gradient norms logged apart."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from bitune.data.sampling import LengthGroupedSampler, grouped_order, padding_share
from bitune.errors import BituneError
from bitune.train.run_folder import checkpoints
from bitune.train.trainer import run_training
from helpers.compare import assert_same_weights, trainable
from helpers.data import samples, varied_lengths
from helpers.dist import Interrupt
from helpers.train import make_trainer, read_log


def skewed_lengths(n: int = 400, seed: int = 0) -> list[tuple[int, int]]:
    """ARC-like: prompts 20-180 tokens, answers 1-30."""
    r = random.Random(seed)
    return [(r.randint(20, 180), r.randint(1, 30)) for _ in range(n)]


def test_grouped_order_is_a_seeded_permutation_of_whole_batches():
    lengths = skewed_lengths(403)
    sampler = LengthGroupedSampler(lengths, batch_size=8, seed=3)
    first = sampler.order()
    assert sorted(first) == list(range(403))
    assert first == LengthGroupedSampler(lengths, batch_size=8, seed=3).order()  # seed + epoch only
    sampler.set_epoch(1)
    assert sampler.order() != first  # a new order per epoch
    assert LengthGroupedSampler(lengths, batch_size=8, seed=4).order() != first
    assert set(first[-3:]) == set(first[400:])  # the short batch stays last, whole


def test_grouping_cuts_padding_below_ten_percent():
    lengths = skewed_lengths(800)
    shuffled = torch.randperm(800, generator=torch.Generator().manual_seed(0)).tolist()
    grouped = grouped_order(lengths, 8, torch.Generator().manual_seed(0))
    random_share, grouped_share = padding_share(lengths, shuffled, 8), padding_share(lengths, grouped, 8)
    assert random_share > 0.25
    assert grouped_share < 0.10


def test_grouping_keeps_instruction_data_under_ten_percent():
    """alpaca_demo's real lengths (answers of 1-497 tokens, spread wider than the prompts) at batch 8: sorting by
    one cost alone left 16% padding; the arrangement by answer length and the pairwise re-splits stay under 10%."""
    lengths = [tuple(x) for x in json.loads((Path(__file__).parent / "alpaca_demo_lengths.json").read_text())["lengths"]]
    assert len(lengths) == 872
    for seed in (0, 42):
        grouped = grouped_order(lengths, 8, torch.Generator().manual_seed(seed))
        assert sorted(grouped) == list(range(872))
        assert padding_share(lengths, grouped, 8) < 0.10
    shuffled = torch.randperm(872, generator=torch.Generator().manual_seed(0)).tolist()
    assert padding_share(lengths, shuffled, 8) > 0.5


def test_padding_share_counts_each_prompt_pass():
    lengths = [(4, 1), (2, 3)]  # batch pads prompts to 4, answers to 3
    assert padding_share(lengths, [0, 1], 2, prompt_reads=2) == pytest.approx(1 - (9 + 7) / (2 * 11))
    assert padding_share(lengths, [0, 1], 2, prompt_reads=1) == pytest.approx(1 - (5 + 5) / (2 * 7))


def test_trainer_groups_batches_by_default_and_logs_padding(tmp_path):
    data = samples(24, lengths=varied_lengths)
    trainer, settings = make_trainer(tmp_path / "g", data=data, batch_size=4, grad_accum=1, steps=6, log_every=3)
    assert trainer.group_by_length
    assert isinstance(trainer.train_sampler(), LengthGroupedSampler)
    run_training(trainer, settings)
    grouped = [r["padding_share"] for r in read_log(tmp_path / "g" / "run") if "loss" in r]
    plain, settings = make_trainer(tmp_path / "p", data=data, batch_size=4, grad_accum=1, steps=6, log_every=3,
                                   group_by_length=False)
    assert not isinstance(plain.train_sampler(), LengthGroupedSampler)
    run_training(plain, settings)
    shuffled = [r["padding_share"] for r in read_log(tmp_path / "p" / "run") if "loss" in r]
    assert len(grouped) == len(shuffled) == 2
    assert sum(grouped) < sum(shuffled)
    one, _ = make_trainer(tmp_path / "one", data=data, batch_size=1)
    assert not one.group_by_length  # nothing to group at batch 1


def test_grouped_resume_matches_uninterrupted_run(tmp_path):
    data = samples(24, lengths=varied_lengths)
    full, settings = make_trainer(tmp_path / "full", data=data, batch_size=4, grad_accum=1, steps=8)
    run_training(full, settings)
    expected = trainable(full.model)
    first, settings = make_trainer(tmp_path / "cut", data=data, batch_size=4, grad_accum=1, steps=8, save_every=4,
                                   callbacks=[Interrupt(at=7)])
    with pytest.raises(KeyboardInterrupt):  # a crash in the second epoch (6 batches per epoch)
        run_training(first, settings)
    assert [p.name for p in checkpoints(tmp_path / "cut" / "run")] == ["checkpoint-4"]  # resumes mid-epoch
    resumed, settings = make_trainer(tmp_path / "cut", data=data, batch_size=4, grad_accum=1, steps=8, save_every=4)
    run_training(resumed, settings, resume=True)
    assert_same_weights(trainable(resumed.model), expected, atol=1e-6)


def test_group_norms_are_logged_and_clip_all_scales_everything(tmp_path):
    trainer, settings = make_trainer(tmp_path, steps=2, max_grad_norm=1e-3)
    run_training(trainer, settings)
    for r in (r for r in read_log(tmp_path / "run") if "loss" in r):
        total = (r["grad_norm_adapters"] ** 2 + r["grad_norm_mixer"] ** 2) ** 0.5
        assert r["grad_norm"] == pytest.approx(total, rel=1e-4)  # the groups split the logged pre-clip norm
        assert r["grad_norm_mixer"] > 0 and r["grad_norm_adapters"] > 0


@pytest.mark.parametrize("clip,limit", [("all", 1e-3), ("adapters", 1e-3), ("all", 0.0), ("all", 1e6)])
def test_logged_group_norms_before_and_after_clipping_are_the_gradients(tmp_path, clip, limit):
    """The norms per group (causal adapters, bidirectional adapters, mixer) before and after clipping, and the
    clip factor, are those of the gradients the optimizer steps with (measured here on the tensors)."""
    trainer, settings = make_trainer(tmp_path, clip=clip, max_grad_norm=limit)
    trainer.make_optimizer()
    trainer.batch_loss(trainer.model, next(iter(trainer.train_loader()))).backward()
    params = trainer.model.trainable_parameters()

    def measured() -> dict[str, float]:
        groups: dict[str, list[float]] = {}
        for k, p in params.items():
            groups.setdefault(k.partition(":")[0], []).append(float(p.grad.double().norm()) ** 2)
        return {g: sum(v) ** 0.5 for g, v in groups.items()}

    before = measured()
    norms = trainer.clip_gradients()
    after = measured()
    assert set(before) == {"causal", "bidir", "mixer"}
    for g in before:
        assert norms[f"grad_norm_{g}"] == pytest.approx(before[g], rel=1e-5)
        assert norms[f"grad_norm_{g}_clipped"] == pytest.approx(after[g], rel=1e-5)
    assert norms["grad_norm"] ** 2 == pytest.approx(sum(v ** 2 for v in before.values()), rel=1e-5)
    assert norms["grad_norm_adapters"] ** 2 == pytest.approx(before["causal"] ** 2 + before["bidir"] ** 2, rel=1e-5)
    factor = norms["clip_factor"]
    clipped = ("causal", "bidir", "mixer") if clip == "all" else ("causal", "bidir")
    if limit in (0.0, 1e6):  # no clipping, or a limit far above the norm: nothing scaled
        assert factor == 1.0 and all(after[g] == pytest.approx(before[g], rel=1e-6) for g in before)
    else:
        scaled = sum(before[g] ** 2 for g in clipped) ** 0.5
        assert factor == pytest.approx(limit / scaled, rel=1e-4) and factor < 1
        for g in before:
            expected = factor * before[g] if g in clipped else before[g]
            assert norms[f"grad_norm_{g}_clipped"] == pytest.approx(expected, rel=1e-4)
        assert sum(after[g] ** 2 for g in clipped) ** 0.5 == pytest.approx(limit, rel=1e-4)


def test_every_logged_step_records_the_norms_per_group_and_the_clip_factor(tmp_path):
    trainer, settings = make_trainer(tmp_path, steps=2, max_grad_norm=1e-3)
    run_training(trainer, settings)
    logged = [r for r in read_log(tmp_path / "run") if "loss" in r]
    assert len(logged) == 2
    for r in logged:
        for g in ("causal", "bidir", "mixer"):
            assert r[f"grad_norm_{g}_clipped"] == pytest.approx(r["clip_factor"] * r[f"grad_norm_{g}"], rel=1e-4)
        assert 0 < r["clip_factor"] < 1


def _clip_once(tmp_path, clip: str) -> tuple[dict, dict]:
    """Gradients of one backward, before and after the trainer's clipping."""
    trainer, settings = make_trainer(tmp_path / clip, clip=clip, max_grad_norm=1e-3)
    trainer.make_optimizer()
    batch = next(iter(trainer.train_loader()))
    trainer.batch_loss(trainer.model, batch).backward()
    before = {k: p.grad.clone() for k, p in trainer.model.trainable_parameters().items() if p.grad is not None}
    trainer.clip_gradients()
    after = {k: p.grad.clone() for k, p in trainer.model.trainable_parameters().items() if p.grad is not None}
    return before, after


def test_clip_adapters_leaves_the_mixer_unclipped(tmp_path):
    before, after = _clip_once(tmp_path, "adapters")
    mixer = [k for k in before if k.startswith("mixer:")]
    adapters = [k for k in before if not k.startswith("mixer:")]
    assert mixer and adapters
    for k in mixer:
        torch.testing.assert_close(after[k], before[k])
    norm = torch.stack([after[k].norm() for k in adapters]).norm()
    assert norm == pytest.approx(1e-3, rel=1e-3)  # clipped to max_grad_norm
    before, after = _clip_once(tmp_path, "all")
    total = torch.stack([after[k].norm() for k in before]).norm()
    assert total == pytest.approx(1e-3, rel=1e-3)
    assert all(after[k].norm() < before[k].norm() for k in mixer)


def test_clip_setting_is_validated():
    from bitune.errors import BituneError
    from bitune.train.settings import TrainSettings

    with pytest.raises(BituneError, match="clip='mixer'"):
        TrainSettings(clip="mixer")


def logged_batches(run_dir: Path) -> list[str]:
    """The per-step batch digests of a run, in step order."""
    return [d for r in read_log(run_dir) if "batches" in r for d in r["batches"]]


def test_methods_and_step_counts_draw_the_same_batches(tmp_path):
    """A study compares methods on the same batches: LoRA r8, LoRA r16, Bitune and LoRA given more steps draw the
    same sequence (the longer run continues it), step for step, as their logs' digests show."""
    data = samples(40, seed=1)
    common = dict(batch_size=2, grad_accum=2, steps=5, log_every=2)
    runs = {"lora": {"bitune": {"variant": "lora"}}, "lora16": {"bitune": {"variant": "lora", "rank": 16}},
            "bitune": {}, "lora_compute": {"bitune": {"variant": "lora"}, "steps": 9},
            "other_seed": {"bitune": {"variant": "lora"}, "seed": 1}}
    digests = {}
    for name, overrides in runs.items():
        trainer, settings = make_trainer(tmp_path / name, data=data, **{**common, **overrides})
        run_training(trainer, settings)
        digests[name] = logged_batches(tmp_path / name / "run")
    lora = digests["lora"]
    assert len(lora) == 5 and len(set(lora)) == 5  # one digest per step, and the steps differ
    assert digests["lora16"] == lora and digests["bitune"] == lora
    assert len(digests["lora_compute"]) == 9 and digests["lora_compute"][:5] == lora
    assert digests["other_seed"] != lora  # the digest sees the order


def test_data_steps_repeats_the_first_steps_batches(tmp_path):
    """``data_steps: N``: the first N steps as a run without it, then those N batches again, in the same order."""
    data = samples(40, seed=1)
    digests = {}
    for name, overrides in {"all": {}, "repeat": {"data_steps": 3}}.items():
        trainer, settings = make_trainer(tmp_path / name, data=data, batch_size=2, grad_accum=2, steps=8,
                                         log_every=3, **overrides)
        run_training(trainer, settings)
        digests[name] = logged_batches(tmp_path / name / "run")
    first = digests["all"][:3]
    assert digests["repeat"] == first + first + first[:2]
    assert digests["all"][3:6] != first


def test_data_steps_past_the_data_is_refused(tmp_path):
    trainer, settings = make_trainer(tmp_path, data=samples(8), batch_size=2, grad_accum=2, data_steps=3)
    with pytest.raises(BituneError, match="data_steps=3 needs 12 training examples.*has 8"):
        run_training(trainer, settings)
