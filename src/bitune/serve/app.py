"""The HTTP app of ``bitune serve`` (FastAPI): routes, the API key and body-size gate, requests turned into
scheduler jobs, answers as JSON or server-sent events.

The scheduler thread sends each job's events into the request's asyncio queue with
``loop.call_soon_threadsafe``; the handler turns them into one response or a stream of OpenAI chunks ending
``data: [DONE]``. A client that goes away cancels its job. Prompts are written exactly as ``bitune generate``
writes them (:func:`bitune.generation.render_messages`, the checkpoint's recorded template); ``/v1/completions``
takes the text as given (template ``none``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from ..errors import BituneError
from ..generation import end_of_turn_ids, max_new_tokens_for, render, render_messages
from . import protocol as api
from .scheduler import Job, QueueFull, Scheduler, SchedulerDown

MAX_BODY_BYTES = 1 << 20
"""Default limit on a request body (1 MiB); larger bodies get 413."""
COMPLETION_DEFAULT_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` generates at most this many tokens (OpenAI's default)."""
FALLBACK_MAX_TOKENS = 4096
"""A chat request without ``max_tokens`` may fill the model's context, or this many tokens if it names none."""


@dataclass
class Served:
    """What the server serves and how it writes prompts.

    Attributes:
        model: the :class:`~bitune.model.BituneModel` (its ``text_config`` gives the maximum position).
        tokenizer: its tokenizer.
        name: the model name clients must send (``model``).
        template: the chat endpoint's template (:func:`bitune.generation.pick_template`): ``"chat"``, ``"paper"``
            or ``"none"`` (verbatim prompts: one user message, as given).
        context (int | None): the model's maximum position (prompt + answer), or None if the config names none
            (set on construction).
        end_ids (dict[str, frozenset[int]]): per template (``template`` and ``"none"``), the token ids that end an
            answer (eos, end of turn).

    Raises:
        BituneError: the tokenizer has no eos token to end answers with.
    """

    model: object
    tokenizer: object
    name: str
    template: str

    def __post_init__(self):
        limit = getattr(self.model.text_config, "max_position_embeddings", None)
        self.context = limit if isinstance(limit, int) else None
        self.end_ids = {t: frozenset(end_of_turn_ids(self.tokenizer, self.model, t))
                        for t in {self.template, "none"}}

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

    def job(self, body, prompt: list[int], default_tokens: int | None, template: str) -> Job:
        """The scheduler job of a request, after the checks that need the prompt's length.

        Args:
            body: the request (``ChatRequest`` or ``CompletionRequest`` of :mod:`bitune.serve.protocol`).
            prompt: the prompt's token ids (:meth:`chat_prompt` or :meth:`completion_prompt`).
            default_tokens: the cap on new tokens when the request names none (None: up to the model's
                maximum position, or ``FALLBACK_MAX_TOKENS`` when the model names none).
            template: which of :attr:`end_ids` ends the answer (unless the request sets ``ignore_eos``).

        Returns:
            The job, its ``max_tokens`` capped so that prompt + answer fit the model's positions.

        Raises:
            bitune.serve.protocol.APIError: 400 when the prompt has fewer than 2 tokens, fills the model's
                positions already, or leaves less room than the request's explicit ``max_tokens`` /
                ``max_completion_tokens`` (``context_length_exceeded``).
        """
        param = "prompt" if isinstance(body, api.CompletionRequest) else "messages"
        if len(prompt) < 2:
            raise api.APIError(400, f"{param}: the prompt has {len(prompt)} token(s); at least 2 are needed (both "
                               "prompt passes read all but the last token, which opens the answer)", param)
        asked = body.limit
        try:  # the library's rule: prompt + answer within the model's positions
            limit = max_new_tokens_for(self.model, len(prompt), next(
                x for x in (asked, default_tokens, self.context, FALLBACK_MAX_TOKENS) if x is not None))
        except BituneError as e:
            raise api.APIError(400, f"{param}: {e}", param, code="context_length_exceeded") from e
        if asked is not None and limit < asked:  # an explicit cap that does not fit is refused, as OpenAI does
            name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise api.APIError(400, f"{name}: {asked} tokens do not fit: the prompt has {len(prompt)} tokens and "
                               f"the model reads at most {self.context} positions (at most {limit} more)", name,
                               code="context_length_exceeded")
        return Job(prompt=prompt, max_tokens=limit, temperature=body.temperature, top_p=body.top_p,
                   seed=body.seed, stop=body.stop,
                   end_ids=frozenset() if body.ignore_eos else self.end_ids[template])


def create_app(served: Served, scheduler: Scheduler, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> Gate:
    """The ASGI app of ``bitune serve``: the FastAPI app behind the :class:`Gate` (API key, then body size).

    Routes: ``GET /health`` (503 once the scheduler thread has stopped), ``GET /v1/models``,
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

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)

    app = FastAPI(title="bitune serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(api.APIError)
    async def _api_error(request, e: api.APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = api.validation_error(list(e.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):
        return JSONResponse(api.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"), 500)

    @app.exception_handler(400)
    async def _unparsable(request, e):  # FastAPI could not decode the body (not UTF-8)
        return JSONResponse(api.error_body("the body is not valid JSON: it could not be decoded as UTF-8",
                                           code="invalid_json"), 400)

    @app.exception_handler(404)
    async def _not_found(request, e):
        return JSONResponse(api.error_body(f"no route {request.method} {request.url.path}", code="not_found"), 404)

    @app.exception_handler(405)
    async def _not_allowed(request, e):
        return JSONResponse(api.error_body(f"{request.method} is not allowed on {request.url.path}",
                                           code="method_not_allowed"), 405)

    @app.get("/health")
    async def health():
        if not scheduler.healthy:
            return JSONResponse({"status": "down", "error": scheduler.failure or "the model's thread is not running"},
                                503)
        return {"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0,
                                            "owned_by": "bitune"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: api.ChatRequest, request: Request):
        _check_model(body.model)
        body.check()
        job = served.job(body, served.chat_prompt(body.turns()), None, served.template)
        rid, name = api.new_id("chatcmpl"), served.name
        if body.stream:
            return _stream(request, job, body.include_usage,
                           opening=api.chat_chunk(rid, name, {"role": "assistant", "content": ""}),
                           chunk=lambda text, finish: api.chat_chunk(rid, name, {"content": text} if text else {},
                                                                     finish),
                           usage_chunk=lambda used: api.chat_chunk(rid, name, None, used=used))
        text, finish, used = await _collect(request, job)
        return api.chat_response(rid, name, text, finish, used)

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        _check_model(body.model)
        body.check()
        job = served.job(body, served.completion_prompt(body.prompt), COMPLETION_DEFAULT_TOKENS, "none")
        rid, name = api.new_id("cmpl"), served.name
        if body.stream:
            return _stream(request, job, body.include_usage, opening=None,
                           chunk=lambda text, finish: api.completion_chunk(rid, name, text, finish),
                           usage_chunk=lambda used: api.completion_chunk(rid, name, None, used=used))
        text, finish, used = await _collect(request, job)
        return api.completion_response(rid, name, text, finish, used)

    def _check_model(name: str) -> None:
        if name != served.name:
            raise api.APIError(404, f"the model {name!r} does not exist; this server serves {served.name!r}",
                               "model", code="model_not_found")

    def _submit(job: Job) -> asyncio.Queue:
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def emit(event):  # called from the scheduler thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is closed: nobody listens any more
                job.cancel()

        job.emit = emit
        try:
            scheduler.submit(job)
        except SchedulerDown as e:
            raise api.APIError(503, f"the server cannot generate: {e}", type="server_error",
                               code="server_down") from e
        except QueueFull as e:
            raise api.APIError(503, f"the server is busy: {e}; retry later", type="server_error",
                               code="queue_full") from e
        return queue

    async def _collect(request: Request, job: Job):
        queue = _submit(job)
        parts = []
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            while True:
                event = await _next_event(queue, gone)
                if event is None:
                    job.cancel()
                    raise api.APIError(499, "the client closed the request")
                if event[0] == "text":
                    parts.append(event[1])
                elif event[0] == "end":
                    return "".join(parts), event[1], api.usage(event[2], event[3])
                else:
                    raise api.APIError(500, event[1], type="server_error", code="generation_failed")
        finally:
            gone.cancel()
            job.cancel()  # no-op once the job ended; a cancelled handler frees the row

    def _stream(request: Request, job: Job, include_usage: bool, opening, chunk, usage_chunk) -> StreamingResponse:
        """Server-sent events: ``opening`` (if any), one ``chunk(text, None)`` per text delta, ``chunk("", finish)``,
        the ``usage_chunk`` if asked for, ``data: [DONE]``."""
        queue = _submit(job)

        def sse(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        async def events():
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                if opening is not None:
                    yield sse(opening)
                while True:
                    event = await _next_event(queue, gone)
                    if event is None:  # the client went away: its row leaves at the next step
                        return
                    if event[0] == "text":
                        yield sse(chunk(event[1], None))
                    elif event[0] == "end":
                        yield sse(chunk("", event[1]))
                        if include_usage:
                            yield sse(usage_chunk(api.usage(event[2], event[3])))
                        break
                    else:
                        yield sse(api.error_body(event[1], type="server_error", code="generation_failed"))
                        break
                yield "data: [DONE]\n\n"
            finally:
                gone.cancel()
                job.cancel()

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return Gate(app, api_key, max_body_bytes)


class Gate:
    """ASGI middleware in front of the app: the API key (``/v1/*``; ``/health`` stays open), then the body size,
    both checked before the body is parsed.

    Args:
        api_key: the key clients send as ``Authorization: Bearer KEY``; None accepts every request.
        max_body_bytes: larger request bodies are answered 413 (also when sent without a Content-Length).
    """

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
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


__all__ = ["Served", "create_app", "Gate", "MAX_BODY_BYTES"]


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection: the body has been read, so the next ASGI message is
    ``http.disconnect`` (no polling)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _next_event(queue: asyncio.Queue, gone: asyncio.Future):
    """The scheduler's next event for this request, or None once ``gone`` (the client's disconnect) is done."""
    if gone.done():
        return None
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    return None
