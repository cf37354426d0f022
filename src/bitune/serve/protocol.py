"""The HTTP shapes of ``bitune serve``: OpenAI request bodies (pydantic, strict), each checked whole on
validation and turned into a scheduler :class:`~bitune.serve.scheduler.Job` by its ``to_job``; the OpenAI error
object; the response and stream-chunk objects. No model code here: the prompt comes tokenized.

A request field the server does not implement is refused with a 400 that names it (never silently ignored):
unknown fields, ``n`` other than 1, ``logprobs``, non-zero penalties, batched prompts.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import BituneError
from ..files import check_text
from ..inputs import check_prompt_length, positions_room
from .scheduler import Job

MAX_STOPS = 4
"""Stop strings per request (OpenAI's limit)."""
COMPLETION_DEFAULT_TOKENS = 16
"""``/v1/completions`` without ``max_tokens`` generates at most this many tokens (OpenAI's default)."""
FALLBACK_MAX_TOKENS = 4096
"""A chat request without ``max_tokens`` may fill the model's context, or this many tokens if it names none."""


class APIError(Exception):
    """An error answered as an OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class InvalidField(ValueError):
    """A check across fields failed (raised in a request's ``model_validator``); ``param`` names the field
    answered as OpenAI's ``param``, which pydantic's location (the whole body) cannot."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 naming the field of the first of pydantic's/FastAPI's validation ``errors``; a check of ours
    (``value_error``) comes first: where a union's other member fails on the type, ours is the one that matched."""
    e = next((x for x in errors if x.get("type") == "value_error"), errors[0])
    cause = e.get("ctx", {}).get("error")
    if isinstance(cause, InvalidField):
        return APIError(400, str(cause), cause.param)
    loc = [str(x) for x in e.get("loc", ())][1:]  # drop "body"
    if e.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}",
                        code="invalid_json")
    parts = []
    for x in loc:
        if x.isdigit():
            parts.append(f"[{x}]")
        elif x.isidentifier() and x not in _TYPE_TAGS:  # pydantic names the union member it tried: skip it
            parts.append(("." if parts else "") + x)
    param = "".join(parts) or None
    kind = e.get("type", "")
    if kind == "extra_forbidden":
        return APIError(400, f"unrecognized request argument supplied: {param} (not supported by this server)",
                        param, code="unsupported_parameter")
    if kind == "missing":
        return APIError(400, f"{param}: this field is required", param, code="missing_required_parameter")
    if not param:
        return APIError(400, f"the body must be a JSON object ({e.get('msg')})", code="invalid_body")
    return APIError(400, f"{param}: {e.get('msg', 'invalid value').removeprefix('Value error, ')}", param,
                    code="invalid_value")


# --------------------------------------------------------------------------------------------------- requests
def _unicode(text: str) -> str:
    """Refuses a lone surrogate: a valid JSON escape (``"\\ud800"``) but not text, which no tokenizer encodes."""
    try:
        return check_text(text, "this text")
    except BituneError as e:
        raise ValueError(str(e)) from None


Text = Annotated[str, AfterValidator(_unicode)]
"""A string that is text: what reaches the tokenizer or is compared with generated text."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    """A text part of a message's content (OpenAI's content-part list); other part types are refused."""

    type: Literal["text"]
    text: Text


class Message(_Strict):
    """One chat message. ``developer`` is OpenAI's newer name for ``system``."""

    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False
    """Send one last chunk with the usage (and no choices) before ``data: [DONE]``."""


class _Sampling(_Strict):
    """Fields shared by both endpoints, and the request turned into a scheduler job."""

    _prompt_param: ClassVar[str]
    """The field that holds the prompt (OpenAI's ``param`` of errors about it)."""
    _default_tokens: ClassVar[int | None] = None
    """The cap on new tokens when the request names none (None: up to the model's maximum position)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    """Cap on generated tokens (prompt + answer must fit the model's context); default: see each endpoint."""
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    """0 is greedy; default 1, as OpenAI's."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-2**63, le=2**64 - 1)
    """Seeds this request's own sampler: the same seeded request gives the same text, alone or among others."""
    stop: Text | list[Text] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    """vLLM's extra field: keep decoding through end tokens until ``max_tokens`` (benchmarks: fixed lengths)."""

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v != 0:
            raise ValueError("penalties are not supported (only 0)")
        return v

    @model_validator(mode="after")
    def _usage_only_streamed(self):
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "only allowed with stream=true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def limit(self) -> int | None:
        """The request's explicit cap on new tokens, if any."""
        return self.max_tokens

    @property
    def _limit_param(self) -> str:
        return "max_tokens"

    def to_job(self, prompt: list[int], context: int | None, end_ids: frozenset[int]) -> Job:
        """The scheduler job of this request, once its prompt is tokenized.

        Args:
            prompt: the prompt's token ids.
            context: the model's maximum position (prompt + answer), or None if it names none.
            end_ids: the token ids that end the answer (not used with ``ignore_eos``).

        Returns:
            The job, its ``max_tokens`` the request's cap (or the endpoint's default, or the model's room) capped
            so that prompt + answer fit the model's positions.

        Raises:
            APIError: 400 when the prompt is too short (:func:`bitune.inputs.check_prompt_length`), fills the
                model's positions already, or leaves less room than the request's explicit ``max_tokens`` /
                ``max_completion_tokens`` (``context_length_exceeded``).
        """
        param = self._prompt_param
        try:
            check_prompt_length(len(prompt))
        except BituneError as e:
            raise APIError(400, f"{param}: {e}", param) from e
        asked = self.limit
        wanted = next(x for x in (asked, self._default_tokens, context, FALLBACK_MAX_TOKENS) if x is not None)
        try:  # the library's rule: prompt + answer within the model's positions
            room = positions_room(context, len(prompt), wanted)
        except BituneError as e:
            raise APIError(400, f"{param}: {e}", param, code="context_length_exceeded") from e
        if asked is not None and room < asked:  # an explicit cap that does not fit is refused, as OpenAI does
            name = self._limit_param
            raise APIError(400, f"{name}: {asked} tokens do not fit: the prompt has {len(prompt)} tokens and the "
                           f"model reads at most {context} positions (at most {room} more)", name,
                           code="context_length_exceeded")
        return Job(prompt=prompt, max_tokens=room, temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                   stop=self.stop or [], end_ids=frozenset() if self.ignore_eos else end_ids)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    _prompt_param = "messages"

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Literal[False] | None = None

    @model_validator(mode="after")
    def _user_last(self):
        if self.messages[-1].role != "user":
            raise InvalidField(f"messages[{len(self.messages) - 1}].role", "the last message must be the user's")
        return self

    @model_validator(mode="after")
    def _one_cap(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidField("max_completion_tokens", "disagrees with max_tokens; give one")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def _limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def turns(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` dicts (``developer`` read as ``system``)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, text or token ids, taken as given."""

    _prompt_param = "prompt"
    _default_tokens = COMPLETION_DEFAULT_TOKENS

    prompt: Text | list[int] | list[Text] = Field(min_length=1)
    logprobs: None = None
    echo: Literal[False] = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of prompts is not supported)")
            return v[0]
        return v


# --------------------------------------------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(id: str, model: str, text: str, finish: str, used: dict) -> dict:
    return {"id": id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": used}


def chat_chunk(id: str, model: str, text: str | None, finish: str | None = None, used: dict | None = None,
               opening: bool = False) -> dict:
    """A ``chat.completion.chunk`` of a text delta; ``text=None`` makes the usage-only chunk (no choices),
    ``opening`` the first chunk (the assistant's role, no text)."""
    delta = {"role": "assistant", "content": ""} if opening else {"content": text} if text else {}
    choices = [] if text is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    return {"id": id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": choices, "usage": used}


def completion_response(id: str, model: str, text: str, finish: str, used: dict) -> dict:
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": used}


def completion_chunk(id: str, model: str, text: str | None, finish: str | None = None,
                     used: dict | None = None) -> dict:
    """A ``text_completion`` chunk of a text delta; ``text=None`` makes the usage-only chunk (no choices)."""
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return {"id": id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": used}
