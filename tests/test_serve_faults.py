"""The server never hangs a request: a failure anywhere in the scheduler's round ends that round's requests with
an error event and later requests are served; a failure of the loop itself marks the scheduler down, ends every
waiting request at once and refuses new ones (faults injected with monkeypatch, once and always)."""

from __future__ import annotations

import threading

import pytest

from bitune.passes import Prefill
from bitune.serve import scheduler as sched
from bitune.serve.scheduler import Job, Scheduler, SchedulerDown
from helpers.serve import PROMPTS, IdTokenizer, scheduler_model

WAIT = 20  # seconds any request may take here at most (a hang fails the test instead of blocking the suite)


def _submit(scheduler: Scheduler, prompt: list[int], max_tokens: int = 4):
    events, done = [], threading.Event()

    def emit(event):
        events.append(event)
        if event.final:
            done.set()

    scheduler.submit(Job(prompt=prompt, max_tokens=max_tokens, emit=emit))
    return events, done


def _ended(pending) -> list[str]:
    """Wait for each request's last event; their kinds ('end' or 'error')."""
    kinds = []
    for events, done in pending:
        assert done.wait(WAIT), "a request was never answered"
        kinds.append(events[-1].kind)
    return kinds


def _raising(original, times: int | None):
    """``original`` that raises RuntimeError on its first ``times`` calls (None: always)."""
    calls = {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if times is None or calls["n"] <= times:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)
    return wrapper


FAULTS = {
    "Prefill.concat": (Prefill, "concat", staticmethod),
    "_Row.__init__": (sched._Row, "__init__", None),
    "_Row.add": (sched._Row, "add", None),
    "Prefill.select": (Prefill, "select", None),
    "Prefill.trimmed": (Prefill, "trimmed", None),
}


@pytest.mark.parametrize("times", [1, None], ids=["once", "always"])
@pytest.mark.parametrize("where", list(FAULTS))
def test_a_failing_round_ends_its_requests_and_the_scheduler_carries_on(monkeypatch, where, times):
    owner, name, wrap = FAULTS[where]
    original = owner.__dict__[name]
    fn = original.__func__ if isinstance(original, staticmethod) else original
    patched = _raising(fn, times)
    monkeypatch.setattr(owner, name, wrap(patched) if wrap else patched)
    scheduler = Scheduler(scheduler_model("llama"), IdTokenizer(), max_batch_size=4, down_after=10)  # see below
    scheduler.start()
    try:
        # two requests of different lengths: rows join a running batch (concat) and one leaves early (select)
        first = [_submit(scheduler, PROMPTS[0], 6), _submit(scheduler, PROMPTS[1], 2)]
        kinds = _ended(first)
        assert set(kinds) <= {"end", "error"}
        assert scheduler.healthy
        later = _ended([_submit(scheduler, PROMPTS[2], 3)])
        if times == 1:
            assert later == ["end"]  # recovered: served as usual
        assert scheduler.healthy
    finally:
        scheduler.stop()


@pytest.mark.parametrize("where", ["prefill", "decode_step"])
def test_batches_failing_one_after_another_mark_the_scheduler_unhealthy_until_an_answer_completes(where):
    """The thread lives on, but no request succeeds: unhealthy after ``down_after`` failed batches in a row (each
    request still gets its error), healthy again once an answer completes."""
    model = scheduler_model("llama")
    original = getattr(model, where)
    setattr(model, where, _raising(original, None))
    scheduler = Scheduler(model, IdTokenizer(), max_batch_size=4, down_after=3)
    scheduler.start()
    try:
        for n in range(1, 5):  # one request at a time: a batch each
            assert _ended([_submit(scheduler, PROMPTS[n % 3], 3)]) == ["error"]
            assert scheduler.healthy == (n < 3), n
        assert "the last 4 batches failed" in scheduler.failing and "injected fault" in scheduler.failing
        setattr(model, where, original)  # the fault passes: requests are still taken, and served
        assert _ended([_submit(scheduler, PROMPTS[0], 3)]) == ["end"]
        assert scheduler.healthy and scheduler.failing is None
    finally:
        scheduler.stop()


def test_health_is_503_while_every_prefill_fails_over_http(tmp_path):
    """Against a server on 127.0.0.1: every request gets its 500 while the prefill fails; /health says 503 with
    the reason from the third failed batch on, and ok again after a request is answered."""
    import json
    import urllib.error
    import urllib.request

    from helpers.gen import save_checkpoint
    from helpers.serve import serving

    def post() -> int:
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
        request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(request, timeout=WAIT).status
        except urllib.error.HTTPError as e:
            return e.code

    def health() -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=WAIT) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    ckpt = save_checkpoint(tmp_path, chat_template=True)[0]
    with serving(ckpt) as (url, scheduler, _):
        model = scheduler.model
        model.prefill = _raising(type(model).prefill.__get__(model), None)
        assert [post() for _ in range(3)] == [500] * 3
        status, body = health()
        assert status == 503 and "the last 3 batches failed" in body["error"] and "injected fault" in body["error"]
        del model.prefill  # the class's own again
        assert post() == 200 and health()[0] == 200


def test_a_failing_event_callback_does_not_take_the_others_down():
    scheduler = Scheduler(scheduler_model("llama"), IdTokenizer(), max_batch_size=4)
    scheduler.start()
    try:
        def broken(event):
            raise RuntimeError("client gone")
        scheduler.submit(Job(prompt=PROMPTS[3], max_tokens=3, emit=broken))
        assert _ended([_submit(scheduler, PROMPTS[0], 3)]) == ["end"]
    finally:
        scheduler.stop()


def test_a_failing_loop_marks_the_scheduler_down_and_ends_every_request(monkeypatch):
    scheduler = Scheduler(scheduler_model("llama"), IdTokenizer(), max_batch_size=4)
    gate = threading.Event()

    class Broken(list):
        """The waiting queue, which fails the loop itself once the requests are in."""

        def popleft(self):
            gate.wait(WAIT)
            raise RuntimeError("injected loop fault")

    scheduler._waiting = Broken()
    scheduler.start()
    pending = [_submit(scheduler, p) for p in PROMPTS[:3]]
    gate.set()
    assert _ended(pending) == ["error"] * 3
    assert "model thread stopped" in pending[0][0][-1].text
    assert not scheduler.healthy and "injected loop fault" in scheduler.failure
    with pytest.raises(SchedulerDown):
        scheduler.submit(Job(prompt=PROMPTS[0], max_tokens=2))
    scheduler.stop()


def test_stop_returns_only_after_the_running_step():
    model = scheduler_model("llama")
    step, entered, release, finished = model.decode_step, threading.Event(), threading.Event(), threading.Event()

    def held(state, pick):  # the step stays on the model until the test releases it
        entered.set()
        assert release.wait(WAIT)
        out = step(state, pick)
        finished.set()
        return out

    model.decode_step = held
    scheduler = Scheduler(model, IdTokenizer())
    scheduler.start()
    pending = [_submit(scheduler, PROMPTS[0], 8)]
    assert entered.wait(WAIT)
    stopping, step_done_at_return = threading.Event(), []

    def stop():
        stopping.set()
        scheduler.stop()
        step_done_at_return.append(finished.is_set())  # what stop's caller sees the moment it returns

    stopper = threading.Thread(target=stop)
    stopper.start()
    assert stopping.wait(WAIT) and not finished.is_set()  # stop is called while the step is on the model
    release.set()
    stopper.join(WAIT)
    assert not stopper.is_alive() and step_done_at_return == [True]  # stop waited for the step
    assert _ended(pending) == ["error"]  # ended by the shutdown, not left waiting


def test_a_dead_scheduler_answers_503_at_once_over_http(tmp_path):
    """With the official client: the request in flight when the loop fails gets a 500 server_error, then
    /health says 503 and every new request gets a 503 at once: refused at submission (``server_down``, which only
    a refused submission answers), never queued."""
    import json
    import urllib.error
    import urllib.request

    openai = pytest.importorskip("openai")
    from helpers.gen import save_checkpoint
    from helpers.serve import serving

    ckpt = save_checkpoint(tmp_path, chat_template=True)[0]
    with serving(ckpt) as (url, scheduler, _):
        class Broken(type(scheduler._waiting)):
            def popleft(self):
                raise RuntimeError("injected loop fault")

        scheduler._waiting = Broken(scheduler._waiting)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=WAIT)
        messages = [{"role": "user", "content": "hi"}]
        with pytest.raises(openai.APIStatusError) as first:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        assert first.value.status_code == 500 and first.value.body["type"] == "server_error"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{url}/health", timeout=WAIT)
        assert health.value.code == 503 and "injected loop fault" in json.loads(health.value.read())["error"]
        with pytest.raises(openai.APIStatusError) as later:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        assert later.value.status_code == 503 and later.value.body["code"] == "server_down"
        assert scheduler.waiting == 0


def test_a_client_that_closes_a_non_streaming_request_frees_its_row(tmp_path):
    """The server notices the closed connection (ASGI http.disconnect) and the row leaves the batch, long before
    its 100 tokens could be generated: its steps are held until the server has cancelled it."""
    import http.client
    import json

    from helpers.gen import save_checkpoint
    from helpers.serve import held_steps, serving, submitted_jobs, wait_until

    ckpt = save_checkpoint(tmp_path, chat_template=True)[0]
    with serving(ckpt) as (url, scheduler, _), held_steps(scheduler) as (entered, release):
        jobs = submitted_jobs(scheduler)
        host, port = url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=WAIT)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100,
                           "ignore_eos": True})
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        assert entered.wait(WAIT) and scheduler.running == 1
        conn.close()  # the client goes away without reading the answer
        wait_until(lambda: jobs[0].cancelled, WAIT, "the server never cancelled the gone client's job")
        release.set()
        wait_until(lambda: scheduler.running == 0, WAIT, "the gone client's row never left the batch")
        assert len(jobs[0].tokens) < 100
