"""Conversational rows (``messages``), rendered with the model's chat template into a prompt and an answer.

A row is ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``, the format of most
instruction datasets and of TRL: an optional system turn, then user and assistant turns. The last message is the
assistant's answer, the one learned; the prompt is everything before it, rendered with the chat template's
generation prompt, so earlier assistant turns are context. The answer is the rest of the rendered conversation
up to and including the template's end-of-turn token (``<|im_end|>`` for SmolLM2, ``<end_of_turn>`` for Gemma 3),
which is what ends an answer in ``bitune generate --template chat``.

Rendering needs the tokenizer, so a row stays a :class:`ChatExample` until tokenization
(:mod:`bitune.data.collate`). The prompt is tokenized exactly as ``bitune generate`` tokenizes a chat prompt (the
template writes its own special tokens), so training and generation read the same tokens; the model then moves the
prompt's last token (the end of the generation prompt) into the answer pass, as for every template.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..errors import BituneError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant")
_MARK = "\ue000"  # a private-use character: finds where an assistant message ends in a rendered conversation


@dataclass
class ChatExample:
    """One conversation whose last message, an assistant turn, is the answer to learn."""

    messages: list[dict[str, str]]
    """The turns, each ``{"role", "content"}``; the last one is the assistant's answer."""
    where: str = "conversation"
    """Where the row came from (``file: row n``), for error messages."""
    id: str | None = None
    """Identifier of the row."""
    template: ClassVar[str] = "chat"
    """How the prompt is written (see ``bitune.config.TEMPLATES``)."""


def chat_example(row: dict, path: Path, n: int) -> ChatExample:
    """Check one ``messages`` row and keep its turns up to the answer.

    Raises:
        BituneError: naming the file, row and field: ``messages`` is not a non-empty list, a turn is not an
            object, a role is unknown, a content is not a string, there is no user turn before the last assistant
            turn, turns follow it, or the answer is empty.
    """
    where = f"{path}: row {n}"
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BituneError(f"{where} field 'messages' must be a non-empty list of {{'role', 'content'}} turns")
    turns = []
    for i, turn in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(turn, dict):
            raise BituneError(f"{where} field '{field}' must be an object with 'role' and 'content'")
        if turn.get("role") not in ROLES:
            raise BituneError(f"{where} field '{field}.role' is {turn.get('role')!r}, not one of {', '.join(ROLES)}")
        if not isinstance(turn.get("content"), str):
            problem = "is missing" if "content" not in turn else "must be a string"
            raise BituneError(f"{where} field '{field}.content' {problem}")
        turns.append({"role": turn["role"], "content": turn["content"]})
    roles = [t["role"] for t in turns]
    if "assistant" not in roles:
        raise BituneError(f"{where} field 'messages' has no assistant turn: nothing to learn")
    last = len(roles) - 1 - roles[::-1].index("assistant")
    if last != len(turns) - 1:
        raise BituneError(f"{where} field 'messages[{last + 1}]' follows the last assistant turn; a conversation "
                          "must end with the assistant answer to learn")
    if "user" not in roles[:last]:
        raise BituneError(f"{where} field 'messages' has no user turn before the last assistant turn")
    if not turns[last]["content"].strip():
        raise BituneError(f"{where} field 'messages[{last}].content' must be a non-empty string (the answer)")
    return ChatExample(messages=turns, where=where, id=str(n))


def _apply(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool, where: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise BituneError(f"{where}: conversational rows need a chat template, and tokenizer "
                          f"{tokenizer.name_or_path!r} has none; use instruction rows (the paper template)")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    except Exception as err:  # jinja2 raises TemplateError (the template's raise_exception) and others
        raise BituneError(f"{where}: the chat template of {tokenizer.name_or_path!r} rejects this conversation: "
                          f"{err}") from err


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The special token the chat template writes right after an assistant message (its end-of-turn token).

    Raises:
        BituneError: No chat template, or it writes no special token after an assistant message.
    """
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y" + _MARK}]
    text = _apply(tokenizer, messages, False, "end-of-turn token")
    after = tokenizer(text[text.rfind(_MARK) + 1:], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if not after or after[0] not in special:
        raise BituneError(f"the chat template of {tokenizer.name_or_path!r} writes no special end-of-turn token "
                          "after an assistant message, so an answer's end cannot be learned")
    return after[0]


def render(tokenizer: PreTrainedTokenizerBase, example: ChatExample) -> tuple[str, str]:
    """``(prompt, rest)``: the conversation before the answer with the generation prompt, and the text the full
    rendering adds after it (the answer, its end-of-turn token and whatever the template writes after that).

    Raises:
        BituneError: The template fails on the conversation, or the full rendering does not start with the prompt
            (the template renders history differently from a generation prompt: prompt and answer cannot be split).
    """
    prompt = _apply(tokenizer, example.messages[:-1], True, example.where)
    full = _apply(tokenizer, example.messages, False, example.where)
    if not full.startswith(prompt):
        raise BituneError(f"{example.where}: the chat template of {tokenizer.name_or_path!r} does not render the "
                          "conversation as the prompt (with its generation prompt) followed by the answer; "
                          "prompt and answer cannot be split")
    return prompt, full[len(prompt):]


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, example: ChatExample,
                   eot: int | None = None) -> tuple[list[int], list[int]]:
    """Prompt and answer token ids of a conversation.

    The prompt is tokenized without added special tokens (the template writes them), as ``bitune generate`` does;
    the answer ends with the end-of-turn token ``eot`` (default: :func:`end_of_turn_id`).

    Returns:
        ``(prompt_ids, answer_ids)``, ``answer_ids[-1] == eot``.
    """
    eot = end_of_turn_id(tokenizer) if eot is None else eot
    prompt, rest = render(tokenizer, example)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    rest_ids = tokenizer(rest, add_special_tokens=False)["input_ids"]
    if eot not in rest_ids:
        raise BituneError(f"{example.where}: the rendered answer {rest!r} holds no end-of-turn token "
                          f"{tokenizer.decode([eot])!r}")
    return prompt_ids, rest_ids[:rest_ids.index(eot) + 1]


__all__ = ["ChatExample", "ROLES", "chat_example", "chat_token_ids", "end_of_turn_id", "render"]
