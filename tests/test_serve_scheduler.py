"""The scheduler without HTTP: rows joining and leaving a running batch decode exactly what each prompt decodes
alone with ``BituneModel.generate`` (the path ``bitune generate`` runs), for full and sliding-window attention."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bitune import BituneConfig, BituneModel
from bitune.serve.scheduler import Job, QueueFull, Scheduler
from conftest import EOS, perturb_adapters, tiny_model
from serve_helpers import greedy_tokens

PROMPTS = [[2, 5, 9, 11, 7], [2, 30, 31], [2, 8, 8, 8, 8, 9, 40, 41, 42], [2, 50, 13, 17], [2, 60, 6]]


class _Tok:
    """The few tokenizer calls the scheduler makes, on ids only (the model is tested, not a vocabulary)."""

    pad_token_id = 0
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4e00 + i) for i in ids)


def _model(arch: str, variant: str = "bitune") -> BituneModel:
    model = BituneModel.wrap(tiny_model(arch), BituneConfig(variant=variant))
    return (perturb_adapters(model, scale=0.3) if variant != "pretrained" else model).eval()


def _run(scheduler: Scheduler, jobs: list[Job], gap: float = 0.0) -> list[list[tuple]]:
    events = [[] for _ in jobs]
    done = [threading.Event() for _ in jobs]
    for i, job in enumerate(jobs):
        def emit(event, i=i):
            events[i].append(event)
            if event[0] != "text":
                done[i].set()
        job.emit = emit
        scheduler.submit(job)
        time.sleep(gap)
    for d in done:
        assert d.wait(60), "a job never ended"
    return events


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_joining_and_leaving_decode_what_each_prompt_decodes_alone(arch):
    model = _model(arch)
    sizes = []
    step = model.decode_step

    def counting(state, pick):
        sizes.append(state.ids.shape[0])
        time.sleep(0.002)  # let later jobs arrive while earlier ones decode
        return step(state, pick)

    model.decode_step = counting
    scheduler = Scheduler(model, _Tok(), max_batch_size=4, max_queue=8)
    scheduler.start()
    lengths = [12, 3, 9, 15, 6]
    jobs = [Job(p, n, end_ids=frozenset()) for p, n in zip(PROMPTS, lengths)]
    try:
        events = _run(scheduler, jobs, gap=0.01)
    finally:
        scheduler.stop()
    for job, n, ev in zip(jobs, lengths, events):
        assert ev[-1] == ("end", "length", len(job.prompt), n)
        assert job.tokens == greedy_tokens(model, job.prompt, [], n)
    assert max(sizes) > 1 and len(set(sizes)) > 1  # rows really ran together, and joined/left between steps


def test_end_token_ends_a_row_and_is_not_text():
    model = _model("llama")
    ref = greedy_tokens(model, PROMPTS[0], [], 10)
    end = ref[3]
    scheduler = Scheduler(model, _Tok())
    scheduler.start()
    job = Job(PROMPTS[0], 10, end_ids=frozenset({end}))
    try:
        events = _run(scheduler, [job])[0]
    finally:
        scheduler.stop()
    first = ref.index(end)
    assert job.tokens == ref[:first + 1] and events[-1] == ("end", "stop", len(PROMPTS[0]), first + 1)
    assert "".join(e[1] for e in events if e[0] == "text") == _Tok().decode(ref[:first])


def test_trimmed_state_decodes_like_the_untrimmed_one():
    model = _model("gemma3")
    ids = torch.tensor([[0, 0, 0, 2, 5, 9], [0, 2, 30, 31, 4, 4]])
    mask = (ids != 0).long()
    pre = model.prefill(ids, mask)
    row = pre.select(torch.tensor([0]))  # its three leading pads are padding in every remaining row
    trimmed = pre.select(torch.tensor([0])).trimmed()
    assert trimmed.ids.shape[1] == row.ids.shape[1] - 3
    a, b = row, trimmed
    for _ in range(6):
        a = model.decode_step(a, lambda x: x.argmax(-1))
        b = model.decode_step(b, lambda x: x.argmax(-1))
        assert torch.equal(a.last_token, b.last_token)


def test_queue_is_bounded():
    model = _model("llama", "pretrained")
    scheduler = Scheduler(model, _Tok(), max_batch_size=1, max_queue=2)  # not started: nothing leaves the queue
    scheduler.submit(Job(PROMPTS[0], 2))
    scheduler.submit(Job(PROMPTS[1], 2))
    with pytest.raises(QueueFull, match="max-queue 2"):
        scheduler.submit(Job(PROMPTS[2], 2))
