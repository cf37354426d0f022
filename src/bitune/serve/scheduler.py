"""Continuous (iteration-level) batching: one thread owns the model and decodes every running request together.

Between two decoding steps the scheduler admits waiting requests: their prompts are read together (one
:meth:`~bitune.model.BituneModel.prefill` over the left-padded batch: both prompt passes, mixed) and their rows
join the running batch (:meth:`~bitune.passes.Prefill.concat`). An idle scheduler that gets a request first
collects the requests that follow it closely (a burst of clients: each arrives within ``batch_wait`` of the one
before, for at most ``10 * batch_wait``), so that a burst's prompts are read in one batch: otherwise the first
request's prompt pass holds the model while the rest arrive, and they wait for it and then for their own pass.
Each step
(:meth:`~bitune.model.BituneModel.decode_step`, the causal weights on the mixed cache, as ``generate`` decodes)
picks every row's next token with that row's own sampling settings and generator. A row leaves the batch
(:meth:`~bitune.passes.Prefill.select`) the step it ends: an end-of-answer token, a stop string, its token
budget, or its client gone. The model code is the library's; this module only decides which rows run when. The
rows live in an engine behind one interface: :class:`EagerBatch` (the default, above) or, with ``--compile``,
:class:`~bitune.serve.slots.SlotBatch` (a preallocated slot cache and a compiled step).

Requests talk to the scheduler through a :class:`Job`: the HTTP side fills in what to generate and an ``emit``
callback (thread-safe), the scheduler calls ``emit`` with each :class:`Event`: text deltas, then one ``end`` or
``error``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers.generation.logits_process import TopPLogitsWarper

from ..data.collate import pad_id
from ..generation import StopText, pad_prompts
from ..passes import Prefill

log = logging.getLogger("bitune.serve")


class QueueFull(Exception):
    """More requests wait than the queue holds (``--max-queue``), or the scheduler is shutting down."""


class SchedulerDown(QueueFull):
    """The scheduler thread has stopped after a failure it could not recover from: no request can be served."""


@dataclass(frozen=True)
class Event:
    """What the scheduler sends a request: text deltas, then exactly one ``end`` or ``error``.

    Attributes:
        kind: ``"text"`` (a delta of the answer), ``"end"`` (the answer is complete) or ``"error"`` (it failed).
        text: the delta (``text``), or what failed (``error``).
        finish_reason: why the answer ended (``end``): ``"stop"`` (an end token or a stop string) or ``"length"``
            (its ``max_tokens``).
        prompt_tokens: the prompt's tokens (``end``).
        completion_tokens: the tokens generated (``end``).
    """

    kind: Literal["text", "end", "error"]
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def final(self) -> bool:
        """Whether this event ends the request (``end`` or ``error``)."""
        return self.kind != "text"


@dataclass
class Job:
    """One request: what to generate and where its events go.

    Attributes:
        prompt: the prompt's token ids (at least 2: the caller checked,
            :func:`~bitune.inputs.check_prompt_length`).
        max_tokens: cap on generated tokens (the caller checked that prompt + answer fit the model).
        temperature: 0 is greedy; else softmax(logits / temperature) is sampled.
        top_p: nucleus mass kept when sampling (transformers' ``TopPLogitsWarper``).
        seed: seeds this request's own generator (None: a random seed).
        stop: stop strings; the text is cut before the first one, which is never sent.
        emit: called from the scheduler thread with each :class:`Event`.
        end_ids: token ids that end the answer (eos, end of turn).
    """

    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    emit: Callable[[Event], None] = lambda event: None
    end_ids: frozenset[int] = frozenset()
    cancelled: bool = False
    tokens: list[int] = field(default_factory=list)

    def cancel(self) -> None:
        """The client is gone: the row leaves the batch at the next step (or is never admitted)."""
        self.cancelled = True


class _Row:
    """A job in the running batch: its sampler and its text so far."""

    def __init__(self, job: Job, tokenizer, device):
        self.job = job
        self.tokenizer = tokenizer
        self.text = StopText(job.stop)
        self.generator = None
        if job.temperature > 0:
            self.generator = torch.Generator(device=device)
            if job.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(job.seed % 2**64)

    def pick(self, logits: torch.Tensor) -> int:
        """The next token from (V,) logits: argmax when greedy, else a draw from this row's generator."""
        if self.generator is None:
            return int(logits.argmax())
        scores = logits.float()[None] / self.job.temperature  # (1, V)
        if self.job.top_p < 1.0:
            scores = TopPLogitsWarper(self.job.top_p)(None, scores)
        return int(torch.multinomial(scores.softmax(-1), 1, generator=self.generator))

    def add(self, token: int) -> str | None:
        """Take the next token, send the text it makes visible; returns the finish reason once the row ends."""
        job = self.job
        job.tokens.append(token)
        ended = token in job.end_ids
        ids = job.tokens[:-1] if ended else job.tokens
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        done = ended or len(job.tokens) >= job.max_tokens
        delta = self.text.update(text if done else text.rstrip("\ufffd"), end=done)  # hold a partial character
        if delta:
            _emit(job, Event("text", delta))
        if ended or self.text.stopped:
            return "stop"
        return "length" if done else None


class EagerBatch:
    """The running rows as one :class:`~bitune.passes.Prefill`, stepped eagerly (the default engine): rows join by
    concatenation (left padding extended), leave by selection, and the cache grows by a position a step.
    :class:`~bitune.serve.slots.SlotBatch` (``--compile``) has the same interface."""

    def __init__(self, model):
        self.model = model
        self.state: Prefill | None = None

    @property
    def size(self) -> int:
        """Running rows."""
        return 0 if self.state is None else self.state.ids.shape[0]

    def join(self, new: Prefill) -> None:
        """Add the rows of a prefill after the running ones."""
        self.state = new if self.state is None else Prefill.concat([self.state, new])

    def step(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """One decoding step of every row (:meth:`~bitune.model.BituneModel.decode_step`)."""
        self.state = self.model.decode_step(self.state, pick)

    def keep(self, keep: list[int]) -> list[int]:
        """Keep rows ``keep``, in order; returns the new order (``keep``)."""
        if len(keep) < self.size:
            index = torch.tensor(keep, device=self.state.ids.device, dtype=torch.long)
            self.state = self.state.select(index).trimmed() if keep else None
        return keep

    def clear(self) -> None:
        self.state = None


class Scheduler:
    """The model's one thread: a bounded queue of waiting jobs and the running decode batch.

    Args:
        model: a :class:`~bitune.model.BituneModel` in eval mode.
        tokenizer: its tokenizer.
        max_batch_size: rows decoded together at most.
        max_queue: jobs waiting for a row at most; :meth:`submit` refuses more.
        batch_wait: seconds an idle scheduler waits for the next request of a burst before it reads the prompts
            it has (0: read the first one at once). Default 0.02.
        down_after: consecutive failed batches (a prompt batch that could not be read, a round that failed) with
            no answer completed since, after which the scheduler reports itself unhealthy (:attr:`failing`) until
            an answer completes again; requests are still taken, so a passing fault heals. Default 3.
        batch: the running rows' engine: None (default) an :class:`EagerBatch`; a
            :class:`~bitune.serve.slots.SlotBatch` of ``max_batch_size`` slots decodes with a compiled step.
    """

    def __init__(self, model, tokenizer, max_batch_size: int = 16, max_queue: int = 64, batch_wait: float = 0.02,
                 down_after: int = 3, batch=None):
        if max_batch_size < 1 or max_queue < 1 or not 0 <= batch_wait <= threading.TIMEOUT_MAX / 10:
            raise ValueError(f"max_batch_size must be >= 1 (got {max_batch_size}), max_queue >= 1 (got {max_queue}: "
                             f"0 refuses every request) and batch_wait in [0, {threading.TIMEOUT_MAX / 10:g}] s "
                             f"(got {batch_wait})")
        if down_after < 1:
            raise ValueError(f"down_after must be >= 1 (got {down_after})")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.max_queue, self.batch_wait = max_batch_size, max_queue, batch_wait
        self.device = next(model.parameters()).device
        self.pad = pad_id(tokenizer)
        self._waiting: collections.deque[Job] = collections.deque()
        if batch is not None and batch.slots != max_batch_size:
            raise ValueError(f"the slot batch holds {batch.slots} rows, not max_batch_size ({max_batch_size})")
        self._rows: list[_Row] = []
        self._batch = batch if batch is not None else EagerBatch(model)
        self._cond = threading.Condition()
        self._closing = False
        self.failure: str | None = None
        """Why the scheduler thread stopped, when it stopped on a failure (then :attr:`healthy` is False)."""
        self.down_after = down_after
        self.failing: str | None = None
        """Why no request is being served although the thread runs: set after ``down_after`` failed batches in a
        row, cleared when an answer completes (while set, :attr:`healthy` is False)."""
        self._failed_batches = 0
        self._thread = threading.Thread(target=self._run, name="bitune-scheduler", daemon=True)

    # ------------------------------------------------------------------------------------------- outside
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; raises :class:`QueueFull` past ``max_queue`` waiting jobs or while shutting down."""
        with self._cond:
            if self.failure is not None:
                raise SchedulerDown(f"the model's thread stopped after a failure ({self.failure})")
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue {self.max_queue})")
            self._waiting.append(job)
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> None:
        """Finish the step under way, end every job left with an error event, and stop the thread. Returns only
        once the thread has stopped (no step is then running on the model), or after ``timeout`` seconds."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        """Whether requests can be served: the thread runs (or has not started), has not failed, its batches are
        not failing one after another (:attr:`failing`) and it is not shutting down (:meth:`submit` then refuses
        every request)."""
        return (self.failure is None and self.failing is None and not self._closing
                and (self._thread.is_alive() or not self._thread.ident))

    @property
    def closing(self) -> bool:
        """Whether :meth:`stop` was called: no new request is taken."""
        return self._closing

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._rows)

    # ------------------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        """The loop. A failure anywhere in a round (reading prompts, joining rows, a decoding step, picking,
        detokenizing, an event callback) ends the requests of that round with an error event and the loop
        carries on with a fresh batch; only a failure of the loop itself stops the thread, which then marks the
        scheduler down (:attr:`healthy` False) and ends every request with an error event."""
        message = "the server shut down before the answer was complete"
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        while not (self._waiting or self._rows or self._closing):
                            self._cond.wait()
                        if not self._rows:
                            self._collect_burst()
                        if self._closing:
                            break
                        admit = []
                        while self._waiting and len(self._rows) + len(admit) < self.max_batch_size:
                            job = self._waiting.popleft()
                            if not job.cancelled:
                                admit.append(job)
                    try:
                        if admit:
                            self._admit(admit)
                        if self._rows:
                            self._step()
                    except Exception as e:  # whatever failed, these requests end now; the next round starts clean
                        log.exception("a scheduler round failed")
                        self._batch_failed(f"generation failed: {type(e).__name__}: {e}")  # before the errors go
                        ended = {id(r.job) for r in self._rows}
                        for job in [*(r.job for r in self._rows), *(j for j in admit if id(j) not in ended)]:
                            _emit(job, Event("error", f"generation failed: {type(e).__name__}: {e}"))
                        self._rows = []
                        self._batch.clear()
        except BaseException as e:
            log.exception("the scheduler thread stopped")
            self.failure = f"{type(e).__name__}: {e}"
            message = f"the server's model thread stopped: {self.failure}"
        finally:
            with self._cond:
                left = [*self._waiting, *(r.job for r in self._rows)]
                self._waiting.clear()
            for job in left:
                _emit(job, Event("error", message))
            self._rows = []
            self._batch.clear()

    def _collect_burst(self) -> None:
        """With the lock held and no running rows: wait while requests keep arriving, each within
        ``batch_wait`` of the one before, for at most ``10 * batch_wait`` in all or until a batch is full."""
        deadline = time.monotonic() + 10 * self.batch_wait
        while not self._closing and len(self._waiting) < self.max_batch_size:
            n, left = len(self._waiting), deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(self.batch_wait, left))
            if len(self._waiting) == n:  # none came within batch_wait (or only a stop)
                return

    def _admit(self, jobs: list[Job]) -> None:
        """Read the new prompts together and join their rows to the running batch."""
        try:
            ids, mask = pad_prompts([j.prompt for j in jobs], self.pad, self.device)  # (n, P)
            new = self.model.prefill(ids, mask)
        except Exception as e:  # a failing prompt must not take the running rows down
            log.exception("prefill failed")
            self._batch_failed(f"reading the prompt failed: {type(e).__name__}: {e}")  # before the errors go
            for job in jobs:
                _emit(job, Event("error", f"reading the prompt failed: {type(e).__name__}: {e}"))
            return
        self._batch.join(new)
        self._rows += [_Row(j, self.tokenizer, self.device) for j in jobs]

    def _step(self) -> None:
        """One decoding step of every running row; rows that end leave the batch."""
        picked: list[int] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,)
            picked.extend(row.pick(x) for row, x in zip(self._rows, logits))
            return torch.tensor(picked, device=logits.device)

        self._batch.step(pick)  # a failure ends every row (the round's guard)
        keep = []
        for i, (row, token) in enumerate(zip(self._rows, picked)):
            finish = None if row.job.cancelled else row.add(token)
            if finish is not None:
                self._answered()  # before the client hears of it
                _emit(row.job, Event("end", finish_reason=finish, prompt_tokens=len(row.job.prompt),
                                     completion_tokens=len(row.job.tokens)))
            elif not row.job.cancelled:
                keep.append(i)
        if len(keep) < len(self._rows):
            self._rows = [self._rows[i] for i in self._batch.keep(keep)]


    def _batch_failed(self, why: str) -> None:
        """Count a batch whose requests all ended with an error; after ``down_after`` in a row, :attr:`failing`."""
        self._failed_batches += 1
        if self._failed_batches >= self.down_after:
            if self.failing is None:
                log.error("%d batches in a row failed: unhealthy until an answer completes", self._failed_batches)
            self.failing = f"the last {self._failed_batches} batches failed, no answer since (last: {why})"

    def _answered(self) -> None:
        """An answer completed: the model serves again."""
        if self.failing is not None:
            log.warning("an answer completed again: healthy")
        self._failed_batches, self.failing = 0, None


def _emit(job: Job, event: Event) -> None:
    """Send an event; a failing callback (its client gone) cancels that request only: its row leaves the batch
    at the next step and the other requests go on."""
    try:
        job.emit(event)
    except Exception:
        log.exception("a request's event callback failed; the request is cancelled")
        job.cancel()
