"""``bitune bench serve``'s pieces: prompts of exact token lengths, the load's statistics, and one tiny run of
our server under load (two clients), all on 127.0.0.1."""

from __future__ import annotations

import types

import pytest
from eval_helpers import tiny_tokenizer
from gen_helpers import save_checkpoint

from bitune.serve.bench import ours, prompts, run_servers, summarize


def test_prompts_have_exactly_the_asked_length_and_differ():
    tok = tiny_tokenizer()
    texts = prompts(tok, 5, 24)
    assert all(len(tok(t)["input_ids"]) == 24 for t in texts) and len(set(texts)) == 5


def test_summary_rates_and_percentiles():
    results = [{"start": 0.0, "first": 0.5, "end": 2.0, "tokens": 10}, {"start": 1.0, "first": 1.2, "end": 4.0,
                                                                         "tokens": 10}]
    s = summarize(results)
    assert s["wall_s"] == 4.0 and s["tokens_per_s"] == 5.0 and s["requests_per_s"] == 0.5
    assert s["ttft_p50_s"] == pytest.approx(0.35) and s["latency_p50_s"] == 2.5
    assert s["latency_p99_s"] == pytest.approx(2.0 + 0.99 * 1.0)


@pytest.mark.slow
def test_a_tiny_load_on_our_server_counts_every_generated_token(tmp_path):
    ckpt, _ = save_checkpoint(tmp_path)
    args = types.SimpleNamespace(threads=1, dtype="float32", device="cpu", rounds=1, requests=2, new_tokens=5)
    server = ours("tiny", ["--checkpoint", str(ckpt)], args, 4)
    texts = prompts(tiny_tokenizer(), 2, 10)
    results = run_servers([[server]], texts, args)["tiny"]  # a request with another token count raises
    assert len(results) == 1 and results[0]["requests"] == 4 and results[0]["tokens_per_s"] > 0
    assert server.process.poll() is not None  # stopped
