"""``bitune bench serve``'s pieces: prompts of exact token lengths, the load's statistics, and one tiny run of
our server under load (two clients), all on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from bitune.bench.serve import checkpoints, ours, run_servers
from bitune.bench.serve_load import Prompts, prompts, summarize
from bitune.bench.serve_processes import cpu_seconds
from bitune.errors import BituneError
from helpers.gen import save_checkpoint
from helpers.tokenizer import tiny_tokenizer


def test_prompts_have_exactly_the_asked_length_and_differ():
    tok = tiny_tokenizer()
    texts = prompts(tok, 5, 24)
    assert all(len(tok(t)["input_ids"]) == 24 for t in texts) and len(set(texts)) == 5


def test_no_prompt_is_sent_twice_and_none_shares_a_cacheable_beginning():
    tok = tiny_tokenizer()
    fresh = Prompts(tok, 40)
    texts = [t for _ in range(4) for t in fresh.take(8)]  # 4 rounds of 8 clients
    assert len(set(texts)) == 32 and all(len(tok(t)["input_ids"]) == 40 for t in texts)
    starts = {tuple(tok(t)["input_ids"][:16]) for t in texts}  # transformers serve caches blocks of 32 tokens
    assert len(starts) == 32


def test_summary_rates_and_percentiles():
    results = [{"start": 0.0, "first": 0.5, "end": 2.0, "tokens": 10}, {"start": 1.0, "first": 1.2, "end": 4.0,
                                                                         "tokens": 10}]
    s = summarize(results)
    assert s["wall_s"] == 4.0 and s["tokens_per_s"] == 5.0 and s["requests_per_s"] == 0.5
    assert s["ttft_p50_s"] == pytest.approx(0.35) and s["latency_p50_s"] == 2.5
    assert s["latency_p99_s"] == pytest.approx(2.0 + 0.99 * 1.0)
    assert s["stream_decode_tok_s"] == pytest.approx((9 / 1.5 + 9 / 2.8) / 2)  # after each stream's first token


def test_cpu_seconds_count_the_work_of_a_process_and_of_its_children():
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    script = (f"import subprocess, sys\ninput()\nsubprocess.run([sys.executable, '-c', {burn!r}])\n"
              "print('done', flush=True)\ninput()\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        before = cpu_seconds(parent)
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "done"  # the child burnt 0.3 s of CPU and was waited for
        assert 0.3 <= cpu_seconds(parent) - before < 5  # (the parent itself only waits)
    finally:
        parent.communicate("\n", timeout=30)


@pytest.mark.slow
def test_a_tiny_load_on_our_server_counts_every_generated_token(tmp_path):
    ckpt, _ = save_checkpoint(tmp_path)
    args = types.SimpleNamespace(threads=1, dtype="float32", device="cpu", rounds=1, requests=2, new_tokens=5)
    server = ours("tiny", ["--checkpoint", str(ckpt)], args, 4)
    args.clients = 2
    results = run_servers([[server]], Prompts(tiny_tokenizer(), 10), args)["tiny"]  # a request with another token count raises
    assert len(results) == 1 and results[0]["requests"] == 4 and results[0]["tokens_per_s"] > 0
    assert 0 < results[0]["cpu_ms_per_token"] < 1000 * results[0]["wall_s"]
    assert server.process.poll() is not None  # stopped


def test_a_server_that_fails_to_start_is_reported_with_its_own_error(tmp_path):
    args = types.SimpleNamespace(threads=1, dtype="float32", device="cpu", rounds=1, requests=1, new_tokens=2)
    server = ours("broken", ["--checkpoint", str(tmp_path / "missing")], args, 1)
    with pytest.raises(BituneError, match="server broken exited with status 2: .*is not a Bitune checkpoint"):
        run_servers([[server]], Prompts(tiny_tokenizer(), 10), args)


def test_given_checkpoints_must_be_what_their_rows_claim(tmp_path):
    lora, _ = save_checkpoint(tmp_path / "l", variant="lora")
    bitune, _ = save_checkpoint(tmp_path / "b")
    base = str(tmp_path / "b" / "base")
    for given, message in (({"lora": str(bitune), "bitune": None}, "--lora .* is a 'bitune' checkpoint"),
                           ({"lora": None, "bitune": str(lora)}, "--bitune .* is a 'lora' checkpoint")):
        with pytest.raises(BituneError, match=message):
            checkpoints(types.SimpleNamespace(model=base, **given), tmp_path)
    with pytest.raises(BituneError, match="the rows would compare different models"):
        checkpoints(types.SimpleNamespace(model="smollm2-135m", bitune=str(bitune), lora=None), tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"prompt_tokens": 10**6}, "do not fit the model's"),
    ({"device": "tpu"}, "--device 'tpu' is not a torch device"),
])
def test_bench_serve_refuses_what_no_server_could_run_before_starting_any(tmp_path, change, message):
    from bitune.bench.serve import bench_serve

    save_checkpoint(tmp_path)
    args = types.SimpleNamespace(**{"clients": 1, "requests": 1, "rounds": 1, "threads": 1, "max_batch_size": 1,
                                    "prompt_tokens": 8, "new_tokens": 2, "device": "cpu",
                                    "model": str(tmp_path / "base"), **change})
    with pytest.raises(BituneError, match=message):
        bench_serve(args)


def test_the_cost_model_bound_is_the_base_request_over_it_plus_bitunes_extra_prompt_reading():
    from bitune.bench.serve import cost_model_bound

    base = {"latency_p50_s": 4.0, "ttft_p50_s": 0.5}
    # Bitune's first tokens come 1.0 s later than the base model's: a request costs 4.0 + 1.0 s, so at best
    # 4 / 5 of the base model's rate
    assert cost_model_bound({"latency_p50_s": 5.2, "ttft_p50_s": 1.5}, base) == pytest.approx(0.8)
    # first tokens no later than the base model's: nothing extra to pay, the bound is 1
    assert cost_model_bound({"latency_p50_s": 4.1, "ttft_p50_s": 0.4}, base) == 1.0


@pytest.mark.parametrize("merge, flags", [(True, []), (False, ["--no-merge"]), ("both", ["--merge-bidir"])])
def test_our_servers_are_started_with_the_merge_and_compile_flags_their_rows_name(merge, flags):
    args = types.SimpleNamespace(clients=8, prompt_tokens=64, new_tokens=64, threads=1, dtype="float32", device=None)
    command = ours("x", ["--model", "m"], args, 16, merge=merge, compile=True).command
    assert [f for f in command if f in ("--no-merge", "--merge-bidir")] == flags
    at = command.index("--compile-buckets")
    assert command[at + 1] == "8" and command[command.index("--max-model-len") + 1] == str(64 + 64 + 8)
