"""``bitune generate``: answers from a checkpoint (or a base model) for one prompt or a JSONL file of prompts.

A prompt is wrapped in a template before tokenization (:func:`bitune.generation.render`): ``paper``, ``chat`` or
``none``. By default the template is the one the checkpoint was trained with (:func:`bitune.generation.pick_template`),
and the command says which it uses. Decoding is greedy unless ``--do-sample``; a single prompt is streamed to the
terminal as it is produced; an empty answer is reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import set_seed

from ..config import TEMPLATES
from ..errors import BituneError
from ..files import (
    check_input_file,
    check_output_file,
    check_replaces_own,
    check_text,
    jsonl_records,
    write_text_atomic,
)
from ..generation import generate_texts, pick_template
from ..loading import load_bitune
from .options import HelpFormatter, add_model_options, add_sampling_options, merge_mode, model_inputs, sampling_options

HELP = "generate answers from a checkpoint"


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
    parser.add_argument("--output", metavar="FILE.jsonl", help="with --input: where answers go (default: stdout); an existing file is "
                        "replaced only when it holds earlier answers")
    parser.add_argument("--template", choices=list(TEMPLATES), default=None,
                        help="paper: 'Question: {prompt}\\n\\nAnswer:'; chat: the tokenizer's chat template; none: "
                             "the prompt as given. Default: the template the checkpoint was trained with; for a base "
                             "model (--model) its chat template if it has one, else paper")
    parser.add_argument("--batch-size", type=int, default=8, help="with --input: prompts per generate call")
    parser.add_argument("--compile", action="store_true",
                        help="decode with torch.compile and a static cache: faster decoding steps, but each new "
                             "batch shape is compiled first (a minute or more on CPU); pays off for long answers")
    add_sampling_options(parser)


def is_answers(rows: list) -> bool:
    """Whether the JSON lines ``rows`` are answers this command wrote (each an object with an ``output`` field):
    the one kind of file ``--output`` replaces."""
    return bool(rows) and all(isinstance(row, dict) and "output" in row for row in rows)


def read_prompts(path: str | Path) -> tuple[list[dict], list[str]]:
    """Records of a JSONL prompt file and the prompt text of each (``prompt``, or ``instruction`` [+ ``input``])."""
    path = check_input_file(path, "--input")
    records, prompts = [], []
    for n, record in jsonl_records(path, "--input"):
        if not isinstance(record, dict) or not ({"prompt", "instruction"} & set(record)):
            raise BituneError(f"{path}:{n}: needs a 'prompt' or an 'instruction' field")
        if "prompt" in record and "instruction" in record:
            raise BituneError(f"{path}:{n}: has both 'prompt' and 'instruction'; give one")
        fields = ("prompt",) if "prompt" in record else ("instruction", "input")
        for name in fields:  # each a string ('input' may be missing or empty)
            value = record.get(name, "")
            if not isinstance(value, str):
                raise BituneError(f"{path}:{n}: '{name}' is {type(value).__name__}, not a string")
            check_text(value, f"{path}:{n}: '{name}'")
        text = record["prompt"] if "prompt" in record else "\n".join(x for x in (record["instruction"],
                                                                                 record.get("input", "")) if x)
        if not text.strip():
            raise BituneError(f"{path}:{n}: the prompt is empty")
        records.append(record)
        prompts.append(text)
    if not records:
        raise BituneError(f"--input {path} holds no prompts")
    return records, prompts


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
        if value < 1:
            raise BituneError(f"{flag} {value}: must be >= 1")
    if args.output is not None and args.input is None:
        raise BituneError("--output needs --input (a single --prompt is printed)")
    if args.prompt is not None and not args.prompt.strip():
        raise BituneError("--prompt is empty")
    if args.prompt is not None:
        check_text(args.prompt, "--prompt")
    if args.output is not None:  # "" too: an error, not stdout
        check_output_file(args.output, "--output", keep=(("--input", args.input), *model_inputs(args)))
        check_replaces_own(args.output, "--output", "answers written by bitune generate", is_answers, form="jsonl")
    records, prompts = read_prompts(args.input) if args.prompt is None else ([], [])  # fail before loading
    sampling = sampling_options(args)
    model, tokenizer = load_bitune(args.checkpoint, args.model, args.base, args.dtype, args.device, args.prompt_passes,
                                   merge=merge_mode(args))
    if args.seed is not None:
        set_seed(args.seed)
    template, why = pick_template(model, tokenizer, args.template)
    print(f"bitune generate: {template} template ({why})", file=sys.stderr)
    common = dict(template=template, max_new_tokens=args.max_new_tokens, stop=args.stop, compile=args.compile, **sampling)
    if args.prompt is not None:
        answers = generate_texts(model, tokenizer, [args.prompt], stream=True, **common)
        _report_empty(answers, template)
        return 0
    answers = generate_texts(model, tokenizer, prompts, batch_size=args.batch_size, **common)
    _report_empty(answers, template)
    lines = "".join(json.dumps({**r, "output": a}) + "\n" for r, a in zip(records, answers))
    if args.output is not None:
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
