"""Multi-turn chat with a Bitune model (paper A.8): :class:`Conversation` (``bitune chat`` is its terminal loop).

Two ways to carry a conversation:

* ``reread`` (A.8 A; once called ``recompute``, the name activation checkpointing now has): every turn
  re-renders the whole history as one prompt and reads it with both prompt passes, so earlier answers are read
  bidirectionally too.
* ``alternating`` (A.8 B): the KV cache is kept between turns; each new user turn is read with both passes on
  top of it and mixed, answers stay causal in the cache. Only the new turn's tokens are computed. The cache
  keeps each answer as generated, its end token included; where the template itself writes that token (chat
  templates' end-of-turn), the cache holds exactly the rendered conversation.

The history is rendered with the tokenizer's chat template when it has one, else with the paper's template
(``Question: ...\\n\\nAnswer: ...`` turns joined by a blank line). Answers stop at eos, at the template's
end-of-turn token, and (paper template) at ``Question:``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from .data.collate import pad_id
from .errors import BituneError
from .files import write_text_atomic
from .generation import (
    StopStreamer,
    answer_room,
    cut_at_stop,
    end_of_turn_ids,
    pad_prompts,
    pick_template,
    render_messages,
)
from .inputs import check_prompt_length

MODES = ("reread", "alternating")
MODE_ALIASES = {"recompute": "reread"}
"""Older chat mode names, still accepted with a deprecation warning: old name -> mode."""
PAPER_STOP = "Question:"
_MARK = "\ue000"  # a private-use character, to find where the last answer ends in a rendered history


def upgrade_mode(mode: str) -> str:
    """``mode`` under its current name: an older one (:data:`MODE_ALIASES`) mapped, with a ``DeprecationWarning``."""
    if mode in MODE_ALIASES:
        warnings.warn(f"chat mode {mode!r} is now called {MODE_ALIASES[mode]!r} ({mode!r} names activation "
                      "checkpointing); the old name is still read", DeprecationWarning, stacklevel=3)
        return MODE_ALIASES[mode]
    return mode


class Conversation:
    """A multi-turn conversation with a :class:`~bitune.model.BituneModel`.

    Args:
        model: the model.
        tokenizer: its tokenizer.
        mode: ``"reread"`` (default) or ``"alternating"`` (see the module docstring); the older name
            ``"recompute"`` is read as ``"reread"``, with a ``DeprecationWarning``.
        template: ``"auto"`` (:func:`bitune.generation.pick_template`: the template the checkpoint was trained with;
            for a base model its chat template if it has one, else ``"paper"``), ``"chat"`` or ``"paper"``.
        max_new_tokens: cap on tokens per answer (lowered where the conversation nears the model's maximum
            position). Default 128.
        stop: extra stop strings (the paper template adds ``Question:``).
        stream: print each answer to stdout as it is produced. Default False.
        **sampling: transformers ``generate`` options (``do_sample``, ``temperature``, ``top_p``, ...).

    Attributes:
        history: the turns so far, ``[{"role": "user" | "assistant", "content": str}, ...]``.
        mode (str): ``"reread"`` or ``"alternating"``.
        template (str): the template the conversation is written with, ``"chat"`` or ``"paper"``.
        why (str): why that template (for the line ``bitune chat`` prints).

    Raises:
        BituneError: ``mode`` or ``template`` is not one of the choices; ``"chat"`` for a tokenizer without a
            chat template; ``"auto"`` for a checkpoint trained on verbatim prompts (template ``none``); the
            tokenizer has no eos token to end answers with.
    """

    def __init__(self, model, tokenizer, mode: str = "reread", template: str = "auto",
                 max_new_tokens: int = 128, stop: list[str] | None = None, stream: bool = False, **sampling):
        mode = upgrade_mode(mode)
        if mode not in MODES:
            raise BituneError(f"chat mode {mode!r} is not one of {list(MODES)}")
        if mode == "alternating" and (why := model.layer_kinds.allows("extend")) is not None:
            raise BituneError(f"chat mode 'alternating' extends the conversation's cache with each prompt's passes, "
                              f"which this model cannot ({why}); use --mode reread")
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        self.why = "as requested"
        if template == "auto":
            template, self.why = pick_template(model, tokenizer)
            if template == "none":
                raise BituneError("the checkpoint was trained on verbatim prompts (template 'none'), which have no "
                                  "turns to continue; choose template 'chat' or 'paper'")
        if template not in ("chat", "paper"):
            raise BituneError(f"chat template {template!r} is not one of ['auto', 'chat', 'paper']")
        if template == "chat" and not has_chat:
            raise BituneError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use template 'paper'")
        self.model, self.tokenizer, self.mode, self.template = model, tokenizer, mode, template
        self.max_new_tokens, self.stream, self.sampling = max_new_tokens, stream, sampling
        self.stops = [*(stop or []), *([PAPER_STOP] if template == "paper" else [])]
        self.eos_ids = end_of_turn_ids(tokenizer, model, template)
        self.markers = [*self.stops, *(tokenizer.decode([i]) for i in self.eos_ids)]
        self.pad = pad_id(tokenizer)
        self.history: list[dict[str, str]] = []
        self.reset()

    @property
    def state(self):
        """Alternating mode: the model's :class:`~bitune.passes.Prefill` of the conversation so far, one row (None
        before the first turn and in reread mode). Its ``ids`` plus ``last_token`` are every token read or
        written."""
        return self._state

    def reset(self) -> None:
        """Forget the conversation: the history and, in alternating mode, its cache."""
        self.history = []
        self._state = None  # alternating mode: the model's cache of the conversation so far
        self._tail = ""  # text the model generated after its last answer (e.g. the eos), already in the cache

    def say(self, text: str) -> str:
        """Add a user turn, generate the answer, add it to the history and return it.

        Args:
            text: the user's message.

        Returns:
            The answer text: what the model generated before the first stop marker (eos, end of turn, a stop
                string), stripped.

        Raises:
            BituneError: the conversation (with this turn) fills the model's positions (:meth:`reset` clears it);
                the rendered prompt or, in alternating mode, the new turn is shorter than 2 tokens; in alternating
                mode, the chat template changes earlier answers' text (use ``"reread"``).
            ValueError: in alternating mode, a model with sliding-window layers would read a conversation as
                long as its window (use ``"reread"``).
        """
        messages = [*self.history, {"role": "user", "content": text}]
        if self._state is None:
            rendered = self.render(messages)
            ids = self.tokenizer(rendered, add_special_tokens=self.template == "paper")["input_ids"]
        else:
            ids = self._new_turn_ids(messages)
        device = next(self.model.parameters()).device
        held = 0 if self._state is None else self._state.ids.shape[1] + 1  # cached tokens and the pending last one
        room = answer_room(self.model, held + len(ids), self.max_new_tokens, "the conversation (/reset clears it)")
        ids, mask = pad_prompts([ids], self.pad, device)  # (1, P)
        out = self.model.generate(
            ids, mask, past=self._state, return_state=self.mode == "alternating", max_new_tokens=room,
            tokenizer=self.tokenizer, stop_strings=self.stops or None, eos_token_id=self.eos_ids,
            pad_token_id=self.pad, streamer=StopStreamer(self.tokenizer, self.markers) if self.stream else None,
            **self.sampling)
        new, self._state = out if self.mode == "alternating" else (out, None)  # (1, N)
        answer, self._tail = self._split_answer(self.tokenizer.decode(new[0], skip_special_tokens=False))
        self.history = [*messages, {"role": "assistant", "content": answer}]
        return answer

    def save(self, path: str | Path) -> None:
        """Write the conversation as JSON: ``{"mode", "template", "messages": history}``, atomically (a temporary
        file renamed into place; the folder is created).

        Args:
            path: the JSON file to write (replaced if it exists).

        Raises:
            BituneError: ``path`` is a folder, or cannot be written (permission denied, a parent is a file).
        """
        record = {"mode": self.mode, "template": self.template, "messages": self.history}
        write_text_atomic(Path(path), json.dumps(record, indent=2, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------------------------------------- rendering
    def render(self, messages: list[dict[str, str]]) -> str:
        """The text of ``messages`` in this conversation's template (:func:`bitune.generation.render_messages`).

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.

        Returns:
            The text; ending with a user turn, it ends with the prompt for the answer.

        Raises:
            BituneError: with the paper template, an assistant message before any user message.
        """
        return render_messages(self.tokenizer, messages, self.template)[0]

    def _new_turn_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Tokens of the new user turn for alternating mode: the full rendering minus what is in the cache.

        The cache holds the rendered history up to the end of the last answer, plus what the model generated
        after it (``_tail``, e.g. the end-of-turn token). The new tokens are the difference between the
        tokenization of the full rendering and of that prefix; where the two disagree at the boundary, the new
        text is tokenized on its own.
        """
        marked = [*messages[:-2], {"role": "assistant", "content": messages[-2]["content"] + _MARK}, messages[-1]]
        rendered = self.render(marked)
        full = self.render(messages)
        end = rendered.find(_MARK)
        if end < 0 or rendered.replace(_MARK, "", 1) != full:
            raise BituneError("the chat template changes the answer text; use mode 'reread'")
        if self._tail and full[end:].startswith(self._tail):
            end += len(self._tail)  # the model already wrote the template's next characters
        special = self.template == "paper"
        full_ids = self.tokenizer(full, add_special_tokens=special)["input_ids"]
        prefix_ids = self.tokenizer(full[:end], add_special_tokens=special)["input_ids"]
        if full_ids[:len(prefix_ids)] == prefix_ids:
            ids = full_ids[len(prefix_ids):]
        else:
            ids = self.tokenizer(full[end:], add_special_tokens=False)["input_ids"]
        check_prompt_length(len(ids), f"the new turn {full[end:]!r}")
        return ids

    def _split_answer(self, raw: str) -> tuple[str, str]:
        """(answer, tail) of a generated text: the answer before the first stop marker, stripped; the rest."""
        cut = cut_at_stop(raw, self.markers).rstrip()
        return cut.strip(), raw[len(cut):]
