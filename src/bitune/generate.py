"""``bitune generate``: answers from a checkpoint (or a base model) for one prompt or a JSONL file of prompts.

A prompt is wrapped in a template before tokenization: ``paper`` (the paper's template,
``Question: {prompt}\\n\\nAnswer:``, tokenized with the tokenizer's special tokens as in training), ``chat`` (the
tokenizer's chat template with the generation prompt) or ``none`` (the text as given). By default the template is
the one the checkpoint was trained with (:func:`pick_template`), and the command says which it uses. Decoding is
greedy unless ``--do-sample``; a single prompt is streamed to the terminal as it is produced; an empty answer is
reported.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from transformers import TextStreamer

from .cli import HelpFormatter, add_prompt_passes_option, add_threads_option
from .config import TEMPLATES
from .data.collate import pad_id, pad_rows
from .errors import BituneError
from .files import check_output_file, check_text, read_text, write_text_atomic

HELP = "generate answers from a checkpoint"


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
    from .data.templates import instruction_example

    return instruction_example(instruction, input, "").prompt


def render(tokenizer, text: str, template: str = "paper") -> tuple[str, bool]:
    """The prompt text for ``template`` and whether to add the tokenizer's special tokens when encoding it.

    The chat template writes its own special tokens (BOS included), so it is encoded without them.
    """
    if template == "paper":
        return paper_prompt(text), True
    if template == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise BituneError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; use --template paper")
        messages = [{"role": "user", "content": text}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), False
    if template == "none":
        return text, True
    raise BituneError(f"--template {template!r} is not one of {list(TEMPLATES)}")


def encode(tokenizer, texts: list[str], add_special_tokens: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(ids, mask)``, each (B, P), of already rendered prompts (at least 2 tokens each)."""
    rows = [tokenizer(t, add_special_tokens=add_special_tokens)["input_ids"] for t in texts]
    return pad_prompts(rows, pad_id(tokenizer), device)


def pad_prompts(rows: list[list[int]], pad: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (B, P) ids and mask of prompts, each at least 2 tokens."""
    for i, r in enumerate(rows):
        if len(r) < 2:
            raise BituneError(f"prompt {i} has {len(r)} token(s); at least 2 are needed")
    return pad_rows(rows, pad, "left", device)


def end_of_turn_ids(tokenizer, model, template: str = "paper") -> list[int]:
    """Tokens that end an answer: eos, the base model's generation eos ids and (chat template) the template's
    end-of-turn token, found as the special token the template writes right after an assistant message."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen_eos = model.weights.base.generation_config.eos_token_id
    ids += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    if template == "chat":
        from .data.conversations import end_of_turn_id
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
class StopStreamer(TextStreamer):
    """transformers' ``TextStreamer`` (prints words as they are decoded) that never prints a stop string.

    Text that could be the start of a stop string is held back until it is known not to be one.
    """

    def __init__(self, tokenizer, stops: list[str] | None = None, file=None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.stops = [s for s in stops or [] if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.file = file
        self.text = ""
        self.shown = 0

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.text += text
        cut = cut_at_stop(self.text, self.stops)
        end = len(cut) if stream_end or len(cut) < len(self.text) else max(self.shown, len(cut) - self.hold)
        print(self.text[self.shown:end], end="\n" if stream_end else "", flush=True, file=self.file or sys.stdout)
        self.shown = max(self.shown, end)


def generate_texts(model, tokenizer, prompts: list[str], template: str = "paper", max_new_tokens: int = 128,
                   stop: list[str] | None = None, batch_size: int = 8, stream: bool = False, **sampling) -> list[str]:
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
        ids, mask = encode(tokenizer, [r for r, _ in rendered], rendered[0][1], device)
        room = answer_room(model, ids.shape[1], max_new_tokens,
                           f"prompt {start + int(mask.sum(1).argmax()) + 1}")  # the longest of the batch
        streamer = StopStreamer(tokenizer, stop) if stream else None
        new = model.generate(ids, mask, max_new_tokens=room, tokenizer=tokenizer,
                             stop_strings=stop or None, pad_token_id=pad_id(tokenizer), streamer=streamer,
                             **sampling)  # (B, N)
        for row in new:
            answers.append(cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stop).strip())
    return answers


def answer_room(model, prompt_tokens: int, max_new_tokens: int, what: str = "the prompt") -> int:
    """``max_new_tokens``, capped (with a note on stderr) so that prompt + answer fit the model's maximum
    position.

    Raises:
        BituneError: the prompt alone reaches the maximum position (names ``what``, its length and the limit).
    """
    limit = getattr(model.text_config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return max_new_tokens
    if prompt_tokens >= limit:
        raise BituneError(f"{what} has {prompt_tokens} tokens, the model reads at most {limit} positions "
                          "(prompt + answer); shorten it")
    if prompt_tokens + max_new_tokens > limit:
        print(f"bitune: {what} has {prompt_tokens} tokens: its answer is capped at {limit - prompt_tokens} new "
              f"tokens (the model's maximum position is {limit})", file=sys.stderr)
        return limit - prompt_tokens
    return max_new_tokens


def sampling_options(args: argparse.Namespace) -> dict:
    """transformers ``generate`` keywords from the sampling flags (unset flags keep the model's defaults)."""
    if not all(isinstance(s, str) and s for s in args.stop):
        raise BituneError("--stop needs a non-empty text (write --stop=TEXT for a text starting with '-')")
    for flag, low, high, closed in (("temperature", 0.0, None, False), ("top_p", 0.0, 1.0, True),
                                    ("repetition_penalty", 0.0, None, False)):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > low and (high is None or value <= high)):
            allowed = f"in ({low:g}, {high:g}]" if high is not None else f"a finite number > {low:g}"
            raise BituneError(f"--{flag.replace('_', '-')} {value}: must be {allowed}")
    if args.top_k is not None and args.top_k < 1:
        raise BituneError(f"--top-k {args.top_k}: must be >= 1")
    opts = {"do_sample": args.do_sample}
    if args.do_sample:
        opts.update({k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None})
    elif any(getattr(args, k) is not None for k in ("temperature", "top_p", "top_k")):
        raise BituneError("--temperature/--top-p/--top-k only apply with --do-sample")
    if args.repetition_penalty is not None:
        opts["repetition_penalty"] = args.repetition_penalty
    return opts


def add_model_options(parser: argparse.ArgumentParser) -> None:
    """--checkpoint/--model/--base/--device/--dtype, shared with ``bitune chat`` and ``bitune plot``."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a Bitune checkpoint folder (e.g. a run's final/)")
    src.add_argument("--model", metavar="NAME", help="a base model name or folder, run untrained ('pretrained')")
    parser.add_argument("--base", metavar="NAME", help="with --checkpoint: base model to load instead of the "
                        "one the checkpoint records")
    parser.add_argument("--device", default=None, help="torch device (unset: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype: float32, bfloat16 or float16")
    add_prompt_passes_option(parser)
    add_threads_option(parser)


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    """Decoding flags, shared with ``bitune chat``."""
    parser.add_argument("--max-new-tokens", type=int, default=128, help="cap on generated tokens per answer")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, help="sampling temperature (with --do-sample)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling mass (with --do-sample)")
    parser.add_argument("--top-k", type=int, help="sample among the k most likely tokens (with --do-sample)")
    parser.add_argument("--repetition-penalty", type=float, help="transformers' repetition penalty (> 1 penalises)")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop an answer at this text (repeatable); the text is cut off")
    parser.add_argument("--seed", type=int, default=None, help="random seed (sampling)")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = HelpFormatter
    parser.description = (
        "Generate answers with a Bitune checkpoint (prompt read by both passes, answer decoded causally) or a "
        "base model. Examples:\n"
        "  bitune generate --checkpoint runs/alpaca/final --prompt 'Name three primary colors.'\n"
        "  bitune generate --checkpoint runs/alpaca/final --input prompts.jsonl --output answers.jsonl\n"
        "  bitune generate --model smollm2-135m --template chat --prompt 'Hi!' --do-sample --temperature 0.7\n"
        "Input JSONL: one object per line with 'prompt' (or 'instruction' and optional 'input'); the output "
        "repeats each object with an 'output' field.")
    add_model_options(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="one prompt; the answer is streamed to the terminal")
    what.add_argument("--input", metavar="FILE.jsonl", help="prompts, one JSON object per line")
    parser.add_argument("--output", metavar="FILE.jsonl", help="with --input: where answers go (default: stdout)")
    parser.add_argument("--template", choices=list(TEMPLATES), default=None,
                        help="paper: 'Question: {prompt}\\n\\nAnswer:'; chat: the tokenizer's chat template; none: "
                             "the prompt as given. Default: the template the checkpoint was trained with; for a base "
                             "model (--model) its chat template if it has one, else paper")
    parser.add_argument("--batch-size", type=int, default=8, help="with --input: prompts per generate call")
    add_sampling_options(parser)


def read_prompts(path: Path) -> tuple[list[dict], list[str]]:
    """Records of a JSONL prompt file and the prompt text of each (``prompt``, or ``instruction`` [+ ``input``])."""
    if not path.is_file():
        raise BituneError(f"--input {path}: no such file")
    records, prompts = [], []
    for n, line in enumerate(read_text(path, "--input").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BituneError(f"{path}:{n}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict) or not ({"prompt", "instruction"} & set(record)):
            raise BituneError(f"{path}:{n}: needs a 'prompt' or an 'instruction' field")
        text = record.get("prompt")
        if text is None:
            text = f"{record['instruction']}\n{record['input']}" if record.get("input") else record["instruction"]
        if not isinstance(text, str) or not text.strip():
            raise BituneError(f"{path}:{n}: the prompt must be a non-empty string")
        check_text(text, f"{path}:{n}: the prompt")
        records.append(record)
        prompts.append(text)
    if not records:
        raise BituneError(f"--input {path} holds no prompts")
    return records, prompts


def run(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1 or args.batch_size < 1:
        raise BituneError("--max-new-tokens and --batch-size must be >= 1")
    if args.output and not args.input:
        raise BituneError("--output needs --input (a single --prompt is printed)")
    if args.prompt is not None and not args.prompt.strip():
        raise BituneError("--prompt is empty")
    if args.prompt is not None:
        check_text(args.prompt, "--prompt")
    if args.output:
        check_output_file(args.output, "--output")  # before the answers are computed
    records, prompts = read_prompts(Path(args.input)) if args.prompt is None else ([], [])  # fail before loading
    sampling = sampling_options(args)
    from .checkpoint import load_bitune

    model, tokenizer = load_bitune(args.checkpoint, args.model, args.base, args.dtype, args.device, args.prompt_passes)
    if args.seed is not None:
        from transformers import set_seed
        set_seed(args.seed)
    template, why = pick_template(model, tokenizer, args.template)
    print(f"bitune generate: {template} template ({why})", file=sys.stderr)
    common = dict(template=template, max_new_tokens=args.max_new_tokens, stop=args.stop, **sampling)
    if args.prompt is not None:
        answers = generate_texts(model, tokenizer, [args.prompt], stream=True, **common)
        _report_empty(answers, template)
        return 0
    answers = generate_texts(model, tokenizer, prompts, batch_size=args.batch_size, **common)
    _report_empty(answers, template)
    lines = "".join(json.dumps({**r, "output": a}) + "\n" for r, a in zip(records, answers))
    if args.output:
        write_text_atomic(Path(args.output), lines)
        print(f"bitune generate: {len(answers)} answers written to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(lines)
    return 0


def _report_empty(answers: list[str], template: str) -> None:
    """Say on stderr how many answers are empty (the model ended at once, or a stop string came first)."""
    empty = [i for i, a in enumerate(answers) if not a]
    if not empty:
        return
    which = "the answer is empty" if len(answers) == 1 else \
        f"{len(empty)} of {len(answers)} answers are empty (first: prompt {empty[0] + 1})"
    print(f"bitune generate: {which}: the model ended its answer (or hit a stop text) at once; if the model was not "
          f"trained with the {template!r} template, try another --template", file=sys.stderr)
