"""``bitune serve --compile``'s engine: the slot cache and its step decode exactly what each prompt decodes alone
with ``BituneModel.generate``, with rows joining and leaving (compacted, the last row moved into a gap), for full
and sliding-window attention; eagerly here, compiled under the slow marker."""

from __future__ import annotations

import concurrent.futures as futures
import threading

import pytest
import torch

from bitune.cli import main
from bitune.errors import BituneError
from bitune.generation import generate_texts
from bitune.loading import load_bitune
from bitune.serve.app import Served
from bitune.serve.scheduler import Job, Scheduler
from bitune.serve.slots import SlotBatch, default_buckets
from helpers.gen import save_checkpoint
from helpers.serve import PROMPTS, Arrivals, IdTokenizer, greedy_tokens, scheduler_model, serving
from test_cli_errors import one_error_line

WAIT = 120


def _serve(model, jobs: list[Job], batch: SlotBatch, arrive_every: int = 2) -> list[int]:
    """Run the jobs through a scheduler on ``batch``: job i arrives during decoding step ``arrive_every * i``
    (from the model's thread: no timing). Returns the batch size of every step."""
    done = [threading.Event() for _ in jobs]
    for job, d in zip(jobs, done):
        job.emit = lambda event, d=d: d.set() if event.final else None
    scheduler = Scheduler(model, IdTokenizer(), max_batch_size=batch.slots, max_queue=8, batch=batch)
    arrivals, step = Arrivals(scheduler, jobs, arrive_every), batch.step
    batch.step = lambda pick: arrivals.step(batch.size) or step(pick)
    return arrivals.run(done, WAIT)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_slot_rows_joining_and_leaving_decode_what_each_prompt_decodes_alone(arch):
    model = scheduler_model(arch)
    lengths = [12, 3, 9, 15, 6]  # rows end out of order: the last row moves into each gap
    jobs = [Job(p, n) for p, n in zip(PROMPTS, lengths)]
    batch = SlotBatch(model, slots=4, length=32, compile=False)
    sizes = _serve(model, jobs, batch)
    for job, n in zip(jobs, lengths):
        assert job.tokens == greedy_tokens(model, job.prompt, [], n)
    assert max(sizes) == 4 and batch.size == 0
    assert 3 in sizes  # a step ran 3 rows on the bucket of 4 (a free row computed and thrown away)


def test_gemma3_rows_past_the_sliding_window_decode_what_they_decode_alone():
    model = scheduler_model("gemma3")  # window 4: prompts of 9 tokens hold fewer keys on the sliding layer
    jobs = [Job(PROMPTS[2], 10), Job(PROMPTS[0], 7), Job(PROMPTS[2][::-1], 5)]
    batch = SlotBatch(model, slots=2, length=24, compile=False)
    _serve(model, jobs, batch, arrive_every=1)
    for job in jobs:
        assert job.tokens == greedy_tokens(model, job.prompt, [], job.max_tokens)


def test_keep_compacts_rows_and_reports_the_new_order():
    model = scheduler_model("llama")
    batch = SlotBatch(model, slots=4, length=32, compile=False)
    prompts = PROMPTS[:4]
    for p in prompts:
        ids = torch.tensor([p])
        batch.join(model.prefill(ids, torch.ones_like(ids)))
    tokens_before = batch.tokens[:4, 0].tolist()
    positions_before = batch.positions[:4, 0].tolist()
    assert positions_before == [len(p) - 1 for p in prompts]
    order = batch.keep([0, 3])  # rows 1 and 2 leave: row 3 moves into row 1
    assert order == [0, 3] and batch.size == 2
    assert batch.tokens[:2, 0].tolist() == [tokens_before[0], tokens_before[3]]
    assert batch.positions[:2, 0].tolist() == [positions_before[0], positions_before[3]]
    assert batch.keep([1]) == [1] and batch.size == 1  # row 0 leaves: the last (old row 3) moves to the front
    assert batch.positions[0, 0] == positions_before[3]


def test_slot_batch_refuses_what_it_cannot_hold():
    model = scheduler_model("llama")
    with pytest.raises(ValueError, match="buckets"):
        SlotBatch(model, slots=4, length=32, buckets=[1, 2], compile=False)  # a step of 4 rows has no bucket
    batch = SlotBatch(model, slots=1, length=4, compile=False)
    long_ = torch.tensor([PROMPTS[2]])  # 9 tokens: 8 cached do not fit 4 positions
    with pytest.raises(ValueError, match="no room"):
        batch.join(model.prefill(long_, torch.ones_like(long_)))
    short = torch.tensor([PROMPTS[1]])
    batch.join(model.prefill(short, torch.ones_like(short)))
    with pytest.raises(ValueError, match="do not fit"):
        batch.join(model.prefill(short, torch.ones_like(short)))
    with pytest.raises(ValueError, match="max_batch_size"):
        Scheduler(model, IdTokenizer(), max_batch_size=2, batch=batch)
    assert default_buckets(16) == [1, 2, 4, 8, 16] and default_buckets(6) == [1, 2, 4, 6]


def test_over_http_the_slot_server_answers_as_bitune_generate_and_refuses_past_its_length(tmp_path):
    openai = pytest.importorskip("openai")
    ckpt, _ = save_checkpoint(tmp_path, chat_template=True)
    prompts = ["what is 2+2?", "name a color.", "hi", "add 3 and 4, then say why.", "list two animals", "x"]
    with serving(ckpt, max_batch_size=4, max_len=96, slots=True) as (url, scheduler, served):
        assert served.context == 96 and scheduler._batch.length == 96
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def chat(prompt):
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=10, temperature=0)

        with futures.ThreadPoolExecutor(len(prompts)) as pool:  # 6 requests on 4 slots: rows join as others end
            replies = list(pool.map(chat, prompts))
        for prompt, reply in zip(prompts, replies):
            assert reply.choices[0].message.content.strip() == generate_texts(served.model, served.tokenizer,
                                                                              [prompt], "chat", 10)[0]
        with pytest.raises(openai.BadRequestError, match="96 positions"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=100)


@pytest.mark.parametrize("argv, message", [
    (["--compile-buckets", "1,2"], "--compile-buckets needs --compile"),
    (["--compile", "--compile-buckets", "0,4"], "each must be in [1, --max-batch-size 16]"),
    (["--compile", "--compile-buckets", "32"], "each must be in [1, --max-batch-size 16]"),
    (["--compile", "--compile-buckets", "two"], "give batch sizes"),
    (["--max-model-len", "1"], "--max-model-len 1: must be >= 3")])
def test_serve_refuses_compile_options_it_cannot_use_before_loading(tmp_path, capsys, argv, message):
    assert main(["serve", "--checkpoint", str(tmp_path / "missing"), "--port", "0", *argv]) == 2
    line = one_error_line(capsys, "serve")
    assert message in line and "checkpoint" not in line


def test_a_max_model_len_past_the_models_positions_is_refused(tmp_path):
    ckpt, _ = save_checkpoint(tmp_path)
    model, tokenizer = load_bitune(str(ckpt), device="cpu")
    positions = model.text_config.max_position_embeddings
    with pytest.raises(BituneError, match=f"exceeds the model's {positions} positions"):
        Served(model, tokenizer, "m", "none", positions + 1)
    assert Served(model, tokenizer, "m", "none", 40).context == 40


@pytest.mark.slow
@pytest.mark.parametrize("arch, variant", [("llama", "bitune"), ("gemma3", "bitune")])  # ~30 s each, compiling
def test_compiled_step_gives_the_eager_servers_greedy_tokens(arch, variant):
    model = scheduler_model(arch, variant)
    lengths = [12, 3, 9, 15, 6]
    jobs = [Job(p, n) for p, n in zip(PROMPTS, lengths)]
    from torch._dynamo.utils import counters

    batch = SlotBatch(model, slots=4, length=32, buckets=[2, 4])  # compiled for 2 and 4 rows, before any request
    assert batch.compile_seconds > 0
    graphs = counters["stats"]["unique_graphs"]
    _serve(model, jobs, batch)
    assert counters["stats"]["unique_graphs"] == graphs  # no request waited on a compile (1 to 4 rows ran)
    for job, n in zip(jobs, lengths):
        assert job.tokens == greedy_tokens(model, job.prompt, [], n)


def test_grouped_attention_equals_sdpa_on_repeated_heads():
    from transformers.integrations.sdpa_attention import repeat_kv

    from bitune.attention import grouped_attention

    g = torch.Generator().manual_seed(0)
    b, heads, kv_heads, q, length, dim = 3, 6, 2, 2, 11, 8
    query = torch.randn(b, heads, q, dim, generator=g)
    key, value = (torch.randn(b, kv_heads, length, dim, generator=g) for _ in range(2))
    mask = torch.rand(b, 1, q, length, generator=g) > 0.3
    mask[..., 0] = True  # every query attends to something
    ref = torch.nn.functional.scaled_dot_product_attention(query, repeat_kv(key, 3), repeat_kv(value, 3),
                                                           attn_mask=mask, scale=0.5)
    out, _ = grouped_attention(None, query, key, value, mask, scaling=0.5)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_a_failing_step_ends_its_rows_and_the_slots_serve_the_next_requests():
    model = scheduler_model("llama")
    batch = SlotBatch(model, slots=2, length=32, compile=False)
    forward, calls = batch._forward, []

    def failing_once(tokens, positions):
        calls.append(tokens.shape[0])
        if len(calls) == 2:
            raise RuntimeError("injected")
        return forward(tokens, positions)

    batch._forward = failing_once
    scheduler = Scheduler(model, IdTokenizer(), max_batch_size=2, batch=batch)
    scheduler.start()
    try:
        events: list = []
        done = threading.Event()
        job = Job(PROMPTS[0], 5, emit=lambda e: (events.append(e), e.final and done.set()))
        scheduler.submit(job)
        assert done.wait(WAIT)
        assert events[-1].kind == "error" and "injected" in events[-1].text and batch.size == 0
        again = Job(PROMPTS[1], 4)
        finished = threading.Event()
        again.emit = lambda e: e.final and finished.set()
        scheduler.submit(again)
        assert finished.wait(WAIT)
        assert again.tokens == greedy_tokens(model, again.prompt, [], 4) and scheduler.healthy
    finally:
        scheduler.stop()
