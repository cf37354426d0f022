"""A ``bitune serve`` app on 127.0.0.1 at a free port, run by uvicorn in a background thread and stopped by the
test; greedy references computed with the library directly; and synchronisation with the scheduler's thread
(held decoding steps, the jobs submitted, a condition awaited), so that no test depends on timing; and, for the
scheduler without HTTP, token-id prompts, a tiny model and an ids-only tokenizer."""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from bitune import BituneModel
from bitune.bench.serve_processes import free_port
from bitune.generation import pick_template
from bitune.loading import load_bitune
from bitune.serve.app import Served, create_app
from bitune.serve.scheduler import Job, Scheduler
from bitune.serve.slots import SlotBatch
from helpers.models import EOS, perturb_adapters, tiny_bitune

WAIT = 60
"""Seconds a test waits for something at most: a hang fails the test instead of blocking the suite."""

PROMPTS = [[2, 5, 9, 11, 7], [2, 30, 31], [2, 8, 8, 8, 8, 9, 40, 41, 42], [2, 50, 13, 17], [2, 60, 6]]
"""Token-id prompts of different lengths (each starting with ``<s>``) for the scheduler's tests."""


class IdTokenizer:
    """The few tokenizer calls the scheduler makes, on ids only (the model is tested, not a vocabulary)."""

    pad_token_id = 0
    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(0x4e00 + i) for i in ids)


def scheduler_model(arch: str, variant: str = "bitune") -> BituneModel:
    """A tiny ``arch`` BituneModel of ``variant`` in eval mode, its adapters perturbed (unless ``pretrained``)."""
    model = tiny_bitune(arch, variant=variant)
    return (perturb_adapters(model, scale=0.3) if variant != "pretrained" else model).eval()


@contextlib.contextmanager
def serving(checkpoint=None, model=None, api_key=None, max_batch_size=16, max_queue=64, max_body_bytes=1 << 20,
            name="tiny", max_len=None, slots=False):
    """Yields ``(base_url, scheduler, served)``; the server is stopped on exit. ``max_len``: the server's
    ``--max-model-len``; ``slots``: run the rows in an (uncompiled) :class:`~bitune.serve.slots.SlotBatch`, the
    engine of ``--compile``."""
    import uvicorn

    bitune, tokenizer = load_bitune(str(checkpoint) if checkpoint else None, model, device="cpu")
    template, _ = pick_template(bitune, tokenizer)
    served = Served(bitune, tokenizer, name, template, max_len)
    batch = SlotBatch(bitune, max_batch_size, served.context, compile=False) if slots else None
    scheduler = Scheduler(bitune, tokenizer, max_batch_size, max_queue, batch=batch)
    app = create_app(served, scheduler, api_key, max_body_bytes)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", scheduler, served
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "the test server did not stop"


@contextlib.contextmanager
def held_steps(scheduler: Scheduler):
    """Hold every decoding step of ``scheduler``'s model until the test releases it: yields ``(entered, release)``
    (``threading.Event``); ``entered`` is set once a step is waiting. On exit the steps are released and the
    model's own ``decode_step`` is back."""
    step, entered, release = scheduler.model.decode_step, threading.Event(), threading.Event()

    def held(state, pick):
        entered.set()
        if not release.wait(WAIT):
            raise TimeoutError("a held decoding step was never released")
        return step(state, pick)

    scheduler.model.decode_step = held
    try:
        yield entered, release
    finally:
        release.set()
        scheduler.model.decode_step = step


def submitted_jobs(scheduler: Scheduler) -> list[Job]:
    """The jobs ``scheduler`` accepts from now on, in order (its ``submit`` wrapped; refused jobs are left out)."""
    jobs, submit = [], scheduler.submit

    def recording(job: Job) -> None:
        submit(job)
        jobs.append(job)

    scheduler.submit = recording
    return jobs


class Arrivals:
    """Jobs arriving while a scheduler decodes, with no timing: job i is submitted during decoding step
    ``every * i``, from the model's own thread. The test's step calls :meth:`step` with the batch size it runs;
    :meth:`run` starts the scheduler, submits the first job, waits for every job to end and stops the scheduler.

    Args:
        scheduler: not started yet.
        jobs: in order of arrival.
        every: decoding steps between two arrivals.
    """

    def __init__(self, scheduler: Scheduler, jobs: list[Job], every: int = 2):
        self.scheduler, self.jobs, self.every = scheduler, jobs, every
        self.sizes: list[int] = []
        """The batch size of every decoding step."""

    def step(self, size: int) -> None:
        """One decoding step of ``size`` rows begins: the next job arrives when it is due."""
        self.sizes.append(size)
        n, every = len(self.sizes), self.every
        if n % every == 0 and n // every < len(self.jobs):
            self.scheduler.submit(self.jobs[n // every])

    def run(self, done: list[threading.Event], wait: float = WAIT) -> list[int]:
        """Serve every job (``done``: one event per job, set at its final event); the batch size of every step."""
        self.scheduler.start()
        try:
            self.scheduler.submit(self.jobs[0])
            for d in done:
                assert d.wait(wait), "a job never ended"
        finally:
            self.scheduler.stop()
        return self.sizes


def wait_until(condition, timeout: float = WAIT, what: str = "the condition never held") -> None:
    """Poll ``condition()`` until it is true; fails with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def greedy_tokens(model, ids: list[int], end_ids, n: int) -> list[int]:
    """The greedy answer ``BituneModel.generate`` (what ``bitune generate`` runs) gives, up to and including the
    first end token."""
    x = torch.tensor([ids])
    new = model.generate(x, torch.ones_like(x), max_new_tokens=n, eos_token_id=list(end_ids), pad_token_id=0)[0]
    out = []
    for t in new.tolist():
        out.append(t)
        if t in end_ids:
            break
    return out


def http(url: str, body: bytes | dict | None = None, headers: dict | None = None, method: str | None = None):
    """``(status, parsed JSON body)`` of one raw request (standard library only: bodies no client would send)."""
    import json
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")
