"""The HTTP app of ``bitune serve`` (FastAPI): the routes, the API key and body-size gate, each request's job
submitted to the scheduler and its events answered as JSON or server-sent events.

A route checks the model's name, tokenizes the prompt (:class:`Served`), lets the body turn itself into a
scheduler job (``to_job`` of :mod:`bitune.serve.protocol`, which also checks the prompt's length and room) and
submits it (:func:`_submit`). The job's events come back through one async iterator (:func:`_events`): the
scheduler thread puts each into the request's asyncio queue (``loop.call_soon_threadsafe``), the iterator
yields them up to the last one and stops early, cancelling the job, when the client goes away. A streaming
request turns them into OpenAI chunks ending ``data: [DONE]`` (:func:`_sse`); any other joins them into one
answer (:func:`_join`). Prompts are written exactly as ``bitune generate`` writes them
(:func:`bitune.generation.render_messages`, the checkpoint's recorded template); ``/v1/completions`` takes the
text as given (template ``none``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import BituneError
from ..generation import end_of_turn_ids, render, render_messages
from ..inputs import max_positions
from . import protocol as api
from .scheduler import Event, Job, QueueFull, Scheduler, SchedulerDown

__all__ = ["Served", "create_app", "Gate", "MAX_BODY_BYTES"]

MAX_BODY_BYTES = 1 << 20
"""Default limit on a request body (1 MiB); larger bodies get 413."""


@dataclass
class Served:
    """What the server serves and how it writes prompts.

    Attributes:
        model: the :class:`~bitune.model.BituneModel` (its ``text_config`` gives the maximum position).
        tokenizer: its tokenizer.
        name: the model name clients must send (``model``).
        template: the chat endpoint's template (:func:`bitune.generation.pick_template`): ``"chat"``, ``"paper"``
            or ``"none"`` (verbatim prompts: one user message, as given).
        context (int | None): the most positions a request uses (prompt + answer): ``max_len``, else the model's
            maximum position, or None if the config names none (set on construction).
        end_ids (dict[str, frozenset[int]]): per template (``template`` and ``"none"``), the token ids that end an
            answer (eos, end of turn).

    Raises:
        BituneError: the tokenizer has no eos token to end answers with.
    """

    model: object
    tokenizer: object
    name: str
    template: str
    max_len: int | None = None
    """Positions a request may use at most, prompt and answer (``--max-model-len``); None: the model's."""

    def __post_init__(self):
        self.context = max_positions(self.model.text_config)
        if self.max_len is not None:
            if self.context is not None and self.max_len > self.context:
                raise BituneError(f"--max-model-len {self.max_len} exceeds the model's {self.context} positions")
            self.context = self.max_len
        self.end_ids = {t: frozenset(end_of_turn_ids(self.tokenizer, self.model, t))
                        for t in {self.template, "none"}}

    def check_model(self, name: str) -> None:
        """Raises :class:`~bitune.serve.protocol.APIError` 404 (``model_not_found``) unless ``name`` is
        :attr:`name`."""
        if name != self.name:
            raise api.APIError(404, f"the model {name!r} does not exist; this server serves {self.name!r}",
                               "model", code="model_not_found")

    def chat_prompt(self, turns: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat request, written with the checkpoint's template.

        Args:
            turns: the request's messages, ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.

        Returns:
            The prompt's token ids.

        Raises:
            bitune.serve.protocol.APIError: 400 when the template cannot write the messages (template ``none``
                with more than one message, an assistant message first with the paper template, or the chat
                template's own refusal).
        """
        if self.template == "none":  # trained on verbatim prompts: one user message, as given
            if len(turns) != 1:
                raise api.APIError(400, "this model was trained on verbatim prompts (template 'none'): send one "
                                   "user message, or use /v1/completions", "messages")
            text, special = render(self.tokenizer, turns[0]["content"], "none")
        else:
            try:
                text, special = render_messages(self.tokenizer, turns, self.template)
            except BituneError as e:
                raise api.APIError(400, f"messages: {e}", "messages") from e
            except Exception as e:  # the chat template's own refusal (e.g. roles must alternate)
                raise api.APIError(400, f"messages: the chat template cannot write these messages: {e}",
                                   "messages") from e
        return self.tokenizer(text, add_special_tokens=special)["input_ids"]

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion request's prompt, taken as given (template ``none``).

        Args:
            prompt: the text (tokenized with the tokenizer's special tokens), or token ids.

        Returns:
            The prompt's token ids.

        Raises:
            bitune.serve.protocol.APIError: 400 when a token id is outside the model's vocabulary.
        """
        if isinstance(prompt, str):
            text, special = render(self.tokenizer, prompt, "none")
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]
        vocab = self.model.weights.base.get_input_embeddings().num_embeddings
        if any(t < 0 or t >= vocab for t in prompt):
            raise api.APIError(400, f"prompt: token ids must be in [0, {vocab})", "prompt")
        return list(prompt)


def create_app(served: Served, scheduler: Scheduler, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> Gate:
    """The ASGI app of ``bitune serve``: the FastAPI app behind the :class:`Gate` (API key, then body size).

    Routes: ``GET /health`` (503 once the scheduler thread has stopped, while its batches fail one after
    another, or while shutting down), ``GET /v1/models``,
    ``POST /v1/chat/completions`` and ``POST /v1/completions`` (OpenAI's bodies, :mod:`bitune.serve.protocol`;
    ``stream: true`` answers with server-sent events). Every error is answered as an OpenAI error object. The
    app's lifespan starts the scheduler thread and stops it at shutdown.

    Args:
        served: the model, its tokenizer, the name clients send and the chat template.
        scheduler: the batching scheduler that runs the model (:class:`bitune.serve.scheduler.Scheduler`);
            started and stopped by the app.
        api_key: the key clients send as ``Authorization: Bearer KEY`` on ``/v1/*`` (``/health`` stays open);
            None (default) accepts every request.
        max_body_bytes: larger request bodies are answered 413. Default ``MAX_BODY_BYTES`` (1 MiB).

    Returns:
        The app, to run with an ASGI server (uvicorn).
    """
    app = FastAPI(title="bitune serve", lifespan=_lifespan, exception_handlers=_ERROR_HANDLERS, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.served, app.state.scheduler = served, scheduler
    app.include_router(_router)
    return Gate(app, api_key, max_body_bytes)


@asynccontextmanager
async def _lifespan(app: FastAPI):
    scheduler = app.state.scheduler
    scheduler.start()
    yield
    await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)


# ------------------------------------------------------------------------------------------------------ routes
def _served(request: Request) -> Served:
    return request.app.state.served


def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


ServedDep = Annotated[Served, Depends(_served)]
SchedulerDep = Annotated[Scheduler, Depends(_scheduler)]
_router = APIRouter()


@_router.get("/health")
async def health(scheduler: SchedulerDep):
    if not scheduler.healthy:
        why = scheduler.failure or scheduler.failing or ("the server is shutting down" if scheduler.closing
                                                         else "the model's thread is not running")
        return JSONResponse({"status": "down", "error": why}, 503)
    return {"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting}


@_router.get("/v1/models")
async def models(served: ServedDep):
    return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "bitune"}]}


@_router.post("/v1/chat/completions")
async def chat(body: api.ChatRequest, request: Request, served: ServedDep, scheduler: SchedulerDep):
    served.check_model(body.model)
    job = body.to_job(served.chat_prompt(body.turns()), served.context, served.end_ids[served.template])
    events = _submit(scheduler, job, request)
    rid = api.new_id("chatcmpl")
    chunk = partial(api.chat_chunk, rid, served.name)
    if body.stream:
        return _stream(events, chunk, body.include_usage, opening=chunk("", opening=True))
    text, end = await _join(events)
    return api.chat_response(rid, served.name, text, end.finish_reason, _usage(end))


@_router.post("/v1/completions")
async def completions(body: api.CompletionRequest, request: Request, served: ServedDep, scheduler: SchedulerDep):
    served.check_model(body.model)
    job = body.to_job(served.completion_prompt(body.prompt), served.context, served.end_ids["none"])
    events = _submit(scheduler, job, request)
    rid = api.new_id("cmpl")
    if body.stream:
        return _stream(events, partial(api.completion_chunk, rid, served.name), body.include_usage)
    text, end = await _join(events)
    return api.completion_response(rid, served.name, text, end.finish_reason, _usage(end))


# ------------------------------------------------------------------------------------------------------ events
def _submit(scheduler: Scheduler, job: Job, request: Request) -> AsyncIterator[Event]:
    """Queue ``job`` now, before any answer starts, and return its events (:func:`_events`).

    Raises:
        bitune.serve.protocol.APIError: 503 ``queue_full`` (past ``--max-queue``, or shutting down) or
            ``server_down`` (the scheduler thread stopped after a failure).
    """
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event: Event) -> None:  # called from the scheduler thread
        try:
            loop.call_soon_threadsafe(queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            job.cancel()

    job.emit = emit
    try:
        scheduler.submit(job)
    except SchedulerDown as e:
        raise api.APIError(503, f"the server cannot generate: {e}", type="server_error", code="server_down") from e
    except QueueFull as e:
        raise api.APIError(503, f"the server is busy: {e}; retry later", type="server_error",
                           code="queue_full") from e
    return _events(job, queue, request)


async def _events(job: Job, queue: asyncio.Queue, request: Request) -> AsyncIterator[Event]:
    """The job's events, up to its final one (``end`` or ``error``); stops early when the client goes away (the
    ASGI ``http.disconnect``). Leaving, either way, cancels the job (a no-op once it ended): a gone client's row
    leaves the batch at the next step."""
    gone, get = asyncio.ensure_future(_disconnected(request)), None
    try:
        while not gone.done():
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                return
            event = get.result()
            yield event
            if event.final:
                return
    finally:
        for task in (get, gone):
            if task is not None:
                task.cancel()
        job.cancel()


async def _join(events: AsyncIterator[Event]) -> tuple[str, Event]:
    """The non-streaming answer: the text deltas joined, and the ``end`` event.

    Raises:
        bitune.serve.protocol.APIError: 500 ``generation_failed`` on an ``error`` event; 499 when the client went
            away first.
    """
    parts, final = [], None
    async for event in events:  # to the iterator's own end: it stops after the final event
        if event.final:
            final = event
        else:
            parts.append(event.text)
    if final is None:
        raise api.APIError(499, "the client closed the request")
    if final.kind == "error":
        raise api.APIError(500, final.text, type="server_error", code="generation_failed")
    return "".join(parts), final


def _stream(events: AsyncIterator[Event], chunk: Callable[..., dict], include_usage: bool,
            opening: dict | None = None) -> StreamingResponse:
    return StreamingResponse(_sse(events, chunk, include_usage, opening), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _sse(events: AsyncIterator[Event], chunk: Callable[..., dict], include_usage: bool,
               opening: dict | None) -> AsyncIterator[str]:
    """Server-sent events: ``opening`` (if any), ``chunk(text)`` per text delta, ``chunk("", finish_reason)`` at the
    end and the usage chunk ``chunk(None, used=...)`` if asked for, or an OpenAI error object on an ``error``
    event; then ``data: [DONE]``. A client gone gets nothing more."""
    async with aclosing(events):
        if opening is not None:
            yield _data(opening)
        async for event in events:
            if event.kind == "text":
                yield _data(chunk(event.text))
            elif event.kind == "end":
                yield _data(chunk("", event.finish_reason))
                if include_usage:
                    yield _data(chunk(None, used=_usage(event)))
            else:
                yield _data(api.error_body(event.text, type="server_error", code="generation_failed"))
            if event.final:
                yield "data: [DONE]\n\n"


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(end: Event) -> dict:
    return api.usage(end.prompt_tokens, end.completion_tokens)


# ------------------------------------------------------------------------------------------------------ errors
async def _api_error(request: Request, e: api.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
    err = api.validation_error(list(e.errors()))
    return JSONResponse(err.body(), status_code=err.status)


async def _unexpected(request: Request, e: Exception) -> JSONResponse:
    return JSONResponse(api.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)


async def _undecodable(request: Request, e) -> JSONResponse:  # FastAPI could not decode the body (not UTF-8)
    return JSONResponse(api.error_body("the body is not valid JSON: it could not be decoded as UTF-8",
                                       code="invalid_json"), 400)


async def _not_found(request: Request, e) -> JSONResponse:
    return JSONResponse(api.error_body(f"no route {request.method} {request.url.path}", code="not_found"), 404)


async def _not_allowed(request: Request, e) -> JSONResponse:
    return JSONResponse(api.error_body(f"{request.method} is not allowed on {request.url.path}",
                                       code="method_not_allowed"), 405)


_ERROR_HANDLERS = {api.APIError: _api_error, RequestValidationError: _invalid, Exception: _unexpected,
                   400: _undecodable, 404: _not_found, 405: _not_allowed}


# -------------------------------------------------------------------------------------------------------- gate
class Gate:
    """ASGI middleware in front of the app: the API key (``/v1/*``; ``/health`` stays open), then the body size,
    both checked before the body is parsed.

    Args:
        api_key: the key clients send as ``Authorization: Bearer KEY``; None accepts every request.
        max_body_bytes: larger request bodies are answered 413 (also when sent without a Content-Length).

    Raises:
        BituneError: ``api_key`` is empty or has whitespace around it (the client's token is compared stripped).
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        if api_key is not None and (not api_key.strip() or api_key != api_key.strip()):
            raise BituneError(f"API key {api_key!r}: empty, or whitespace around it; clients send the key stripped, "
                              "so no request could match")
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            token = given[7:].strip() if given[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                what = "no API key given (send Authorization: Bearer KEY)" if not given else "incorrect API key"
                return await _send_error(send, 401, api.error_body(what, code="invalid_api_key"))
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, 413, self._too_large())
        chunks, size = [], 0
        while True:  # read the whole body first (never more than the limit)
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await _send_error(send, 413, self._too_large())
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_large(self) -> dict:
        return api.error_body(f"the request body is larger than {self.max_body_bytes} bytes", code="body_too_large")


async def _send_error(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection: the body has been read, so the next ASGI message is
    ``http.disconnect`` (no polling)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
