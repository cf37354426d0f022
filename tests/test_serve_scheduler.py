"""The scheduler without HTTP: rows joining and leaving a running batch decode exactly what each prompt decodes
alone with ``BituneModel.generate`` (the path ``bitune generate`` runs), for full and sliding-window attention."""

from __future__ import annotations

import threading

import pytest
import torch

from bitune.serve.scheduler import Event, Job, QueueFull, Scheduler
from helpers.serve import PROMPTS, Arrivals, IdTokenizer, greedy_tokens, scheduler_model

WAIT = 60  # seconds a job may take here at most (a hang fails the test instead of blocking the suite)


def _listen(jobs: list[Job]) -> tuple[list[list[Event]], list[threading.Event]]:
    """Each job's events as they come, and a threading.Event per job, set at its final event."""
    events, done = [[] for _ in jobs], [threading.Event() for _ in jobs]
    for job, got, ended in zip(jobs, events, done):
        def emit(event, got=got, ended=ended):
            got.append(event)
            if event.final:
                ended.set()
        job.emit = emit
    return events, done


def _run(scheduler: Scheduler, jobs: list[Job]) -> list[list[Event]]:
    """Submit the jobs at once; their events once every job has ended."""
    events, done = _listen(jobs)
    for job in jobs:
        scheduler.submit(job)
    for d in done:
        assert d.wait(WAIT), "a job never ended"
    return events


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_rows_joining_and_leaving_decode_what_each_prompt_decodes_alone(arch):
    model = scheduler_model(arch)
    lengths = [12, 3, 9, 15, 6]
    jobs = [Job(p, n, end_ids=frozenset()) for p, n in zip(PROMPTS, lengths)]
    events, done = _listen(jobs)
    arrivals = Arrivals(Scheduler(model, IdTokenizer(), max_batch_size=4, max_queue=8), jobs)  # job i: step 2i
    step = model.decode_step
    model.decode_step = lambda state, pick: arrivals.step(state.ids.shape[0]) or step(state, pick)
    sizes = arrivals.run(done, WAIT)
    for job, n, ev in zip(jobs, lengths, events):
        assert ev[-1] == Event("end", finish_reason="length", prompt_tokens=len(job.prompt), completion_tokens=n)
        assert job.tokens == greedy_tokens(model, job.prompt, [], n)
    assert sizes[:3] == [1, 1, 2]  # job 1 joined the running row between steps 2 and 3
    assert max(sizes) == 4 and sizes[-1] == 1  # at most max_batch_size rows together; rows left as they ended


def test_end_token_ends_a_row_and_is_not_text():
    model = scheduler_model("llama")
    ref = greedy_tokens(model, PROMPTS[0], [], 10)
    end = ref[3]
    scheduler = Scheduler(model, IdTokenizer())
    scheduler.start()
    job = Job(PROMPTS[0], 10, end_ids=frozenset({end}))
    try:
        events = _run(scheduler, [job])[0]
    finally:
        scheduler.stop()
    first = ref.index(end)
    assert job.tokens == ref[:first + 1]
    assert events[-1] == Event("end", finish_reason="stop", prompt_tokens=len(PROMPTS[0]), completion_tokens=first + 1)
    assert "".join(e.text for e in events if e.kind == "text") == IdTokenizer().decode(ref[:first])


def test_trimmed_state_decodes_like_the_untrimmed_one():
    model = scheduler_model("gemma3")
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
    model = scheduler_model("llama", "pretrained")
    scheduler = Scheduler(model, IdTokenizer(), max_batch_size=1, max_queue=2)  # not started: nothing leaves the queue
    scheduler.submit(Job(PROMPTS[0], 2))
    scheduler.submit(Job(PROMPTS[1], 2))
    with pytest.raises(QueueFull, match="max-queue 2"):
        scheduler.submit(Job(PROMPTS[2], 2))


def _prefill_sizes(model) -> list[int]:
    """Record the rows of every prompt batch the scheduler reads."""
    sizes, prefill = [], model.prefill
    model.prefill = lambda ids, mask, *a, **k: sizes.append(ids.shape[0]) or prefill(ids, mask, *a, **k)
    return sizes


def test_a_burst_of_requests_at_an_idle_scheduler_is_read_in_one_batch():
    model = scheduler_model("llama")
    sizes = _prefill_sizes(model)
    jobs = [Job(p, 3) for p in PROMPTS[:4]]
    events, done = _listen(jobs)
    scheduler = Scheduler(model, IdTokenizer(), batch_wait=1.0)  # each request within 1 s of the one before
    scheduler.start()
    try:
        for job in jobs:  # the first one finds the scheduler idle; the others follow it 20 ms apart
            scheduler.submit(job)
            threading.Event().wait(0.02)
        for d in done:
            assert d.wait(WAIT), "a job never ended"
    finally:
        scheduler.stop()
    assert sizes == [4]
    for job in jobs:
        assert job.tokens == greedy_tokens(model, job.prompt, [], 3)


def test_the_burst_wait_ends_when_a_batch_is_full_and_at_stop():
    model = scheduler_model("llama")
    sizes = _prefill_sizes(model)
    scheduler = Scheduler(model, IdTokenizer(), max_batch_size=2, batch_wait=30.0)
    scheduler.start()
    try:
        jobs = [Job(p, 2) for p in PROMPTS[:2]]
        assert all(events[-1].kind == "end" for events in _run(scheduler, jobs))  # long before 30 s: batch full
        assert sizes == [2]
        late = Job(PROMPTS[2], 2)
        events, done = _listen([late])
        scheduler.submit(late)  # alone: the scheduler would wait up to 30 s for another
    finally:
        scheduler.stop(timeout=WAIT)
    assert done[0].wait(WAIT) and events[0][-1].kind == "error" and "shut down" in events[0][-1].text
    assert sizes == [2]  # stopping ended the wait; the lone prompt was never read
