"""`bitune bench` runs end to end on a tiny local model and reports the ratios it promises."""

from __future__ import annotations

import json

import pytest

from bitune.cli import main
from helpers.gen import save_checkpoint


def test_bench_train_reports_time_memory_and_flop_ratios(tmp_path):
    save_checkpoint(tmp_path)
    out = tmp_path / "train.json"
    assert main(["bench", "train", "--model", str(tmp_path / "base"), "--lengths", "8:8,16:4", "--steps", "1",
                 "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt"], r["answer"]) for r in rows] == [(8, 8), (16, 4)]
    assert rows[0]["flop_ratio"] == 1.5 and rows[1]["flop_ratio"] == 36 / 20
    assert json.loads(out.read_text())["default"] == "fused"  # what prompt_passes="auto" trains with
    for r in rows:
        assert r["time_ratio"] == r["time_ratio_fused"] > 0
        for path in ("fused", "batched", "sequential"):
            assert r[f"memory_ratio_{path}"] > 1  # Bitune saves more for backward than LoRA


def test_bench_generate_reports_prefill_and_decode(tmp_path):
    save_checkpoint(tmp_path)
    out = tmp_path / "gen.json"
    assert main(["bench", "generate", "--model", str(tmp_path / "base"), "--prompt-tokens", "12",
                 "--new-tokens", "4", "--repeats", "1", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"base", "base_copy", "lora", "lora_unmerged", "bitune", "bitune_sequential",
                                   "bitune_unmerged", "bitune_merged_bidir"}
    assert result["memory_ratio"]["bitune_merged_bidir"] > result["memory_ratio"]["bitune"]  # the bidir copy
    assert result["default"] == "batched"  # what prompt_passes="auto" reads prompts with
    for name in ("base_copy", "lora", "bitune", "bitune_sequential", "bitune_unmerged", "bitune_merged_bidir"):
        assert result[name]["prefill_ratio"] > 0 and result[name]["decode_ratio"] > 0


def test_bench_rejects_malformed_lengths(tmp_path, capsys):
    assert main(["bench", "train", "--lengths", "64"]) == 2
    assert "PROMPT:ANSWER" in capsys.readouterr().err


def test_bench_train_refuses_lengths_past_the_models_positions(tmp_path, capsys):
    save_checkpoint(tmp_path)
    assert main(["bench", "train", "--model", str(tmp_path / "base"), "--lengths", "8:8,100000:10"]) == 2
    assert "must fit the model's" in capsys.readouterr().err


def test_bench_rejects_impossible_counts(capsys):
    assert main(["bench", "generate", "--new-tokens", "1"]) == 2
    assert "--new-tokens >= 2" in capsys.readouterr().err
    assert main(["bench", "train", "--steps", "0"]) == 2
    assert "--steps >= 1" in capsys.readouterr().err
    assert main(["bench", "train", "--threads", "-1"]) == 2
    assert "--threads -1" in capsys.readouterr().err


def test_bench_data_runs_on_a_config_and_reports_real_token_rates(tmp_path):
    save_checkpoint(tmp_path)
    rows = [{"instruction": "w " * (2 + 5 * (i % 7)), "output": "x " * (1 + 3 * (i % 4))} for i in range(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tmp_path / 'base'}\ndataset: {data}\nbatch_size: 4\nmax_length: 120\n")
    out = tmp_path / "data.json"
    assert main(["bench", "data", "--config", str(config), "--steps", "2", "--output", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["batch_size"] == 4 and r["steps"] == 2 and r["real_tokens"] > 0
    assert 1 < r["flop_ratio"] < 2 and r["time_ratio"] > 0
    assert r["padding_share"]["grouped"] < r["padding_share"]["random"]
    assert set(r["tokens_per_s"]) == {"lora", "bitune"}
    assert main(["bench", "data", "--config", str(config), "--steps", "30"]) == 2  # 31 batches of 4 > 40 rows


def test_bench_eval_times_hf_pretrained_and_two_pass_bitune_on_the_same_requests(tmp_path, monkeypatch):
    from lm_eval.api.instance import Instance

    from bitune.bench import eval as bench_eval

    save_checkpoint(tmp_path)

    class FakeTask:  # three 3-choice questions, as a multiple-choice task hands them to the model
        OUTPUT_TYPE = "multiple_choice"
        instances: list = []

        def build_all_requests(self, limit=None):
            self.instances = [Instance(request_type="loglikelihood", doc={}, arguments=(f"q{q} pick one:", f" c{c}"),
                                       idx=c, metadata=("fake", q, 1)) for q in range(3) for c in range(3)]

    monkeypatch.setattr(bench_eval, "make_task", lambda name: FakeTask())
    record = tmp_path / "eval.json"
    assert main(["bench", "eval", "--model", str(tmp_path / "base"), "--task", "fake", "--limit", "3",
                 "--batch-size", "2", "--rounds", "2", "--output", str(record)]) == 0
    out = json.loads(record.read_text())
    assert out["questions"] == 3 and out["requests"] == 9 and out["rounds"] == 2
    for name in ("hf", "pretrained", "bitune"):
        assert len(out[f"{name}_s"]) == 2 and out[f"{name}_questions_per_s"] > 0
    assert out["max_abs_logprob_diff"] < 1e-4 and out["greedy_agree"]  # pretrained scores = lm-eval's hf
    # positions each one's forwards computed: two-pass Bitune reads every prompt twice, the answers once
    hf, pre, bit = (out["positions"][name] for name in ("hf", "pretrained", "bitune"))
    assert 0 < pre < bit < 2 * pre and out["pretrained_position_ratio"] == round(hf / pre, 3)
    assert len(out["load_average_before"]) == 3 and out["bitune_merge"] == "causal"
    both = tmp_path / "eval-both.json"
    assert main(["bench", "eval", "--model", str(tmp_path / "base"), "--task", "fake", "--limit", "3",
                 "--batch-size", "2", "--rounds", "1", "--merge-bidir", "--output", str(both)]) == 0
    assert json.loads(both.read_text())["bitune_merge"] == "both"


def test_bench_eval_refuses_impossible_counts_before_loading_anything(capsys):
    assert main(["bench", "eval", "--model", "no-such-model", "--rounds", "0"]) == 2
    assert "--rounds >= 1" in capsys.readouterr().err


def test_saved_bytes_counts_activations_apart_from_the_weights_backward_keeps():
    """What a forward saves for backward, each storage once: the input and output activations, and the weight a
    linear layer keeps (a view of the parameter) only in ``total``; the leaf input and the parameter never."""
    import torch

    from bitune.bench.helpers import count_saved

    lin = torch.nn.Linear(4, 8)
    x = torch.randn(3, 4, requires_grad=True)
    with count_saved() as saved:
        lin(x * 2).relu()
    assert saved.activations == 4 * (3 * 4 + 3 * 8)  # (3, 4) input of the linear layer, (3, 8) output of relu
    assert saved.total == saved.activations + lin.weight.nbytes  # weight.t(), saved for the input's gradient


@pytest.mark.slow
@pytest.mark.parametrize("meta", [False, True])
def test_bench_sharding_halves_static_memory_and_checkpointing_cuts_activations(tmp_path, meta):
    """2 processes: FSDP2 holds half of DDP's parameters, gradients and AdamW state per process; checkpointing
    saves fewer activations; counting on the meta device gives the same parameter bytes as a real step."""
    save_checkpoint(tmp_path)
    out = tmp_path / "sharding.json"
    assert main(["bench", "sharding", "--model", str(tmp_path / "base"), "--prompt", "8", "--answer", "4",
                 "--output", str(out)] + (["--meta"] if meta else [])) == 0
    runs = {(r["wrap"], r["checkpointing"]): r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {(w, c) for w in ("ddp", "fsdp") for c in (False, True)}
    for c in (False, True):
        ddp, fsdp = runs["ddp", c], runs["fsdp", c]
        assert fsdp["static_vs_ddp"] == fsdp["static"] / ddp["static"] <= 0.55
        assert fsdp["params"] * 2 >= ddp["params"] and fsdp["optimizer"] * 2 >= ddp["optimizer"] > 0
    for w in ("ddp", "fsdp"):
        assert 0 < runs[w, True]["activation_bytes"] < runs[w, False]["activation_bytes"]


def test_bench_sharding_needs_two_processes(capsys):
    assert main(["bench", "sharding", "--num-processes", "1"]) == 2
    assert "--num-processes >= 2" in capsys.readouterr().err
    assert main(["bench", "sharding", "--prompt", "1"]) == 2
    assert "--prompt >= 2" in capsys.readouterr().err


def test_bench_decode_times_our_step_against_the_models_forward(tmp_path):
    save_checkpoint(tmp_path)
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--model", str(tmp_path / "base"), "--batch-sizes", "1,3", "--context", "8",
                 "--steps", "3", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"1", "3"}
    for r in rows.values():
        assert r["step_ms"] > 0 and r["forward_ms"] > 0
        assert sum(r["profile_share"].values()) == pytest.approx(1.0)
        assert r["profile_share"]["matmuls"] > 0


def test_bench_decode_rejects_bad_batch_sizes(capsys):
    assert main(["bench", "decode", "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err


def test_bench_prefill_times_both_reading_paths_and_names_autos_choice(tmp_path, monkeypatch):
    import bitune.model

    monkeypatch.setattr(bitune.model, "BATCHED_PREFILL_MAX_POSITIONS", 20)
    save_checkpoint(tmp_path)
    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--model", str(tmp_path / "base"), "--lengths", "8,32", "--batch-sizes", "1,2",
                 "--rounds", "1", "--output", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["prompt_tokens"]) for r in rows] == [(1, 8), (1, 32), (2, 8), (2, 32)]
    assert [r["auto"] for r in rows] == ["batched", "sequential", "batched", "sequential"]  # 7, 31, 14, 62 positions
    for r in rows:
        assert r["base_s"] > 0 and r["batched_over_sequential"] == pytest.approx(r["batched_s"] / r["sequential_s"])
        assert r["auto_over_base"] == pytest.approx(r[f"{r['auto']}_s"] / r["base_s"])
    assert main(["bench", "prefill", "--lengths", "8,2"]) == 2


def test_token_floors_count_each_context_once_and_every_answer_position():
    """Two questions: contexts of 5 and 3 tokens, choices of 2+1 and 3 tokens. hf reads context + choice - 1 per
    request: (5+2-1) + (5+1-1) + (3+3-1) = 16; read once, the contexts cost 4 + 2 tokens, the answer pass x_P once
    per context and each choice but its last token: (1 + 1 + 0) + (1 + 2) = 5."""
    from types import SimpleNamespace

    from bitune.bench.eval import token_floors

    class Encoder:  # the two BituneLM methods token_floors uses, on space-separated "tokens"
        @staticmethod
        def _encode_pair(ctx, cont):
            return ctx.split(), cont.split()

        @staticmethod
        def _fit(ctx, cont):
            return ctx, cont

    requests = [SimpleNamespace(args=args) for args in
                (("a b c d e", "x y"), ("a b c d e", "z"), ("f g h", "u v w"))]
    floors = token_floors(Encoder(), requests)
    assert (floors["hf_tokens"], floors["prompt_tokens"], floors["answer_tokens"]) == (16, 6, 5)
    assert floors["pretrained_token_floor"] == round(16 / 11, 3) and floors["bitune_token_floor"] == round(16 / 17, 3)
