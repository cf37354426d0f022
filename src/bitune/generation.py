"""Generation helpers shared by ``bitune generate``, ``bitune chat``, ``bitune plot`` and the Python API: the
template a prompt is written with (:func:`pick_template`, :func:`render`), left-padded prompt batches, the tokens
and texts that end an answer, and batched generation (:func:`generate_texts`).

A prompt is wrapped in a template before tokenization: ``paper`` (the paper's template,
``Question: {prompt}\\n\\nAnswer:``, tokenized with the tokenizer's special tokens as in training), ``chat`` (the
tokenizer's chat template with the generation prompt) or ``none`` (the text as given).
"""

from __future__ import annotations

import sys

import torch
from transformers import TextStreamer

from .config import TEMPLATES
from .data.collate import pad_id, pad_rows
from .data.conversations import end_of_turn_id
from .data.templates import instruction_example
from .errors import BituneError
from .inputs import check_prompt_length, context_room, max_positions


# --------------------------------------------------------------------------------------------------- prompts
def pick_template(model, tokenizer, requested: str | None = None) -> tuple[str, str]:
    """The template to write prompts with, and why (for the line every verb prints).

    ``requested`` wins; else the template the checkpoint records (``BituneConfig.template``; checkpoints written
    before it was recorded read as ``paper``, the one they were trained with); else (a base model, or a model wrapped
    in Python) the tokenizer's chat template if it has one, otherwise ``paper``.
    """
    if requested is not None:
        return requested, "as requested"
    if model.config.template is not None:
        return model.config.template, "the template the checkpoint was trained with"
    what = "the base model" if model.config.variant == "pretrained" else "no template recorded; the tokenizer"
    if getattr(tokenizer, "chat_template", None):
        return "chat", f"{what} has a chat template"
    return "paper", f"{what} has no chat template"


def paper_prompt(instruction: str, input: str | None = None) -> str:
    """The paper's instruction template (:func:`bitune.data.templates.instruction_example`), prompt part."""
    return instruction_example(instruction, input, "").prompt


def render(tokenizer, text: str, template: str = "paper") -> tuple[str, bool]:
    """The prompt text for ``template`` and whether to add the tokenizer's special tokens when encoding it.

    The chat template writes its own special tokens (BOS included), so it is encoded without them.
    """
    if template == "none":
        return text, True
    return render_messages(tokenizer, [{"role": "user", "content": text}], template)


def render_messages(tokenizer, messages: list[dict[str, str]], template: str = "paper") -> tuple[str, bool]:
    """The text of a conversation and whether to add the tokenizer's special tokens when encoding it.

    Ending with a user turn, the text ends with the prompt for the answer. ``chat``: the tokenizer's chat template
    (every role it knows). ``paper``: one ``Question: ...\\n\\nAnswer:`` turn per user message, each assistant
    answer after its question (a space in between), turns joined by a blank line; system messages come first, as
    plain paragraphs.

    Args:
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
        template: ``"paper"`` or ``"chat"`` (``"none"`` has no turns).
    """
    if template == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise BituneError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use --template paper")
        return tokenizer.apply_chat_template(messages, add_generation_prompt=messages[-1]["role"] == "user",
                                             tokenize=False), False
    if template == "paper":
        system, turns = [], []
        for m in messages:
            if m["role"] == "system":
                system.append(m["content"])
            elif m["role"] == "user":
                turns.append(paper_prompt(m["content"]))
            elif turns:
                turns[-1] += f" {m['content']}"
            else:
                raise BituneError("an assistant message must follow a user message (paper template)")
        return "\n\n".join(system + turns), True
    if template == "none":
        raise BituneError("template 'none' (verbatim prompts) has no turns: give the text as one prompt")
    raise BituneError(f"--template {template!r} is not one of {list(TEMPLATES)}")


def encode(tokenizer, texts: list[str], add_special_tokens: bool, device=None,
           first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(ids, mask)``, each (B, P), of already rendered prompts (at least 2 tokens each); ``first``:
    the index of ``texts[0]`` among all prompts, for errors."""
    rows = [tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"] for t in texts]
    return pad_prompts(rows, pad_id(tokenizer), device, first)


def pad_prompts(rows: list[list[int]], pad: int, device=None, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and mask of prompts, each at least 2 tokens
    (:func:`~bitune.inputs.check_prompt_length`; errors count prompts from 1, the first of ``rows`` being number
    ``first + 1``)."""
    for i, r in enumerate(rows):
        check_prompt_length(len(r), f"prompt {first + i + 1}")
    return pad_rows(rows, pad, "left", device)


def end_of_turn_ids(tokenizer, model, template: str = "paper") -> list[int]:
    """Tokens that end an answer: eos, the base model's generation eos ids and (chat template) the template's
    end-of-turn token, found as the special token the template writes right after an assistant message."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen_eos = model.weights.base.generation_config.eos_token_id
    ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    if template == "chat":
        try:
            ids.append(end_of_turn_id(tokenizer))
        except BituneError:
            pass  # a template without a special end-of-turn token: eos ends answers
    if not ids:
        raise BituneError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to end answers with")
    return list(dict.fromkeys(ids))


def cut_at_stop(text: str, stops: list[str] | None) -> str:
    """``text`` up to the first occurrence of any stop string."""
    ends = [i for i in (text.find(s) for s in stops or [] if s) if i >= 0]
    return text[:min(ends)] if ends else text


# --------------------------------------------------------------------------------------------------- generation
class StopText:
    """An answer's text as it grows, never showing a stop string: text that could be the start of one is held
    back until it is known not to be.

    Attributes:
        shown: characters of the text shown so far.
        stopped: whether the text reached a stop string.
    """

    def __init__(self, stops: list[str] | None = None):
        self.stops = [s for s in stops or [] if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.shown = 0
        self.stopped = False

    def update(self, text: str, end: bool = False) -> str:
        """Take the whole text so far; return what newly becomes visible (``end``: the text is complete)."""
        cut = cut_at_stop(text, self.stops)
        self.stopped = len(cut) < len(text)
        stop = len(cut) if end or self.stopped else max(self.shown, len(cut) - self.hold)
        new = text[self.shown:stop]
        self.shown = max(self.shown, stop)
        return new


class StopStreamer(TextStreamer):
    """transformers' ``TextStreamer`` (prints words as they are decoded) that never prints a stop string."""

    def __init__(self, tokenizer, stops: list[str] | None = None, file=None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.stop_text = StopText(stops)
        self.file = file
        self.text = ""

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text
        print(self.stop_text.update(self.text, stream_end), end="\n" if stream_end else "", flush=True,
              file=self.file or sys.stdout)


def generate_texts(model, tokenizer, prompts: list[str], template: str = "paper", max_new_tokens: int = 128,
                   stop: list[str] | None = None, batch_size: int = 8, stream: bool = False, compile: bool = False,
                   **sampling) -> list[str]:
    """Answers to ``prompts``, in order, in batches of left-padded prompts.

    Args:
        model: a :class:`~bitune.model.BituneModel`.
        tokenizer: its tokenizer.
        prompts: user texts, wrapped by ``template`` (see :func:`render`).
        template: ``"paper"``, ``"chat"`` or ``"none"``.
        max_new_tokens: cap on generated tokens per answer.
        stop: stop strings; generation stops at one and the answer is cut before it.
        batch_size: prompts per ``generate`` call.
        stream: print the tokens to stdout as they are produced (needs a single prompt).
        compile: decode with ``torch.compile`` (``BituneModel.generate(compile=True)``).
        sampling: ``do_sample``, ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ... for
            transformers' ``generate``.

    Returns:
        One answer per prompt, stop strings and surrounding whitespace removed.
    """
    if stream and len(prompts) != 1:
        raise BituneError("streaming needs a single prompt")
    device = next(model.parameters()).device
    sampling.setdefault("eos_token_id", end_of_turn_ids(tokenizer, model, template))
    answers = []
    for start in range(0, len(prompts), batch_size):
        rendered = [render(tokenizer, p, template) for p in prompts[start:start + batch_size]]
        ids, mask = encode(tokenizer, [r for r, _ in rendered], rendered[0][1], device, start)
        room = answer_room(model, ids.shape[1], max_new_tokens,
                           f"prompt {start + int(mask.sum(1).argmax()) + 1}")  # the longest of the batch
        streamer = StopStreamer(tokenizer, stop) if stream else None
        new = model.generate(ids, mask, max_new_tokens=room, tokenizer=tokenizer,
                             stop_strings=stop or None, pad_token_id=pad_id(tokenizer), streamer=streamer,
                             compile=compile, **sampling)  # (B, N)
        for row in new:
            answers.append(cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stop).strip())
    return answers


def max_new_tokens_for(model, prompt_tokens: int, requested: int, what: str = "the prompt") -> int:
    """The new tokens a prompt of ``prompt_tokens`` tokens may get: ``requested``, capped at the model's maximum
    position (prompt + answer). Below ``requested`` means capped: tell the user (``bitune generate`` and ``chat``
    print one line, see :func:`answer_room`). :meth:`BituneModel.generate <bitune.model.BituneModel.generate>`
    applies the same cap itself, so no caller decodes past the model's positions.

    Raises:
        BituneError: the prompt alone reaches the maximum position (names ``what``, its length and the limit).
    """
    return context_room(model.text_config, prompt_tokens, requested, what)


def answer_room(model, prompt_tokens: int, max_new_tokens: int, what: str = "the prompt") -> int:
    """:func:`max_new_tokens_for`, with one line on stderr when the answer is capped."""
    room = max_new_tokens_for(model, prompt_tokens, max_new_tokens, what)
    if room < max_new_tokens:
        limit = max_positions(model.text_config)
        print(f"bitune: {what} has {prompt_tokens} tokens: its answer is capped at {room} new tokens (the model's "
              f"maximum position is {limit})", file=sys.stderr)
    return room
