"""``bitune eval``: evaluate a checkpoint or a base model on the paper's benchmarks with lm-evaluation-harness
(:func:`bitune.eval.evaluate.evaluate_run`), writing one result JSON per run for ``bitune report``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import BituneError
from ..files import check_named, check_output_file, check_replaces_own
from ..records import RESULT_FILE, SCHEMA
from .options import add_merge_option, add_prompt_passes_option, add_threads_option, merge_mode, model_inputs

HELP = "evaluate a checkpoint or base model with lm-evaluation-harness"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Evaluate a Bitune checkpoint (any variant) or a base model (as the 'pretrained' "
                          "baseline), zero-shot, on the paper's benchmarks read offline. Example:\n"
                          "  bitune eval --checkpoint runs/piqa-42/final --tasks piqa,arc_challenge --limit 100")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="a Bitune checkpoint folder (e.g. a run's final/)")
    src.add_argument("--model", metavar="NAME", help="a base model name or folder, evaluated untrained")
    parser.add_argument("--base", metavar="NAME", help="with --checkpoint: base model to load instead of the "
                        "one the checkpoint records")
    parser.add_argument("--tasks", default="piqa,arc_challenge,csqa,siqa,mmlu",
                        help="comma-separated: piqa, arc_challenge, arc_easy, csqa, siqa, mmlu, gsm8k")
    parser.add_argument("--template", choices=("paper", "chat"), default=None,
                        help="paper: the tasks' prompts as they are (the paper's templates); chat: each prompt as a "
                             "user turn of the tokenizer's chat template, the choice right after the generation "
                             "prompt. Default: the template the checkpoint was trained with; paper for a base model "
                             "(--model), as the paper scores the pretrained baseline")
    parser.add_argument("--split", default=None, metavar="SPLIT",
                        help="which questions: 'reported' (default: the split the paper reports, e.g. ARC test, "
                             "CSQA validation), 'tuning' (the split to tune on, never the reported one: ARC "
                             "validation; CSQA/PIQA/SIQA 'dev', 500 training questions that 'train_no_dev' "
                             "leaves out) or a split name; recorded in the result")
    parser.add_argument("--limit", type=int, help="evaluate only the first N questions of each task")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per forward pass")
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype: float32, bfloat16 or float16")
    add_prompt_passes_option(parser)
    add_merge_option(parser)
    parser.add_argument("--num-processes", type=int, default=1, metavar="N",
                        help="score the questions in N local processes (each every N-th question, gathered on the "
                             "first: lm-eval's data-parallel protocol; one GPU each, or the CPU cores shared over "
                             "gloo); not needed under torchrun/accelerate launch")
    parser.add_argument("--seed", type=int, default=1234, help="lm-eval's random seeds (sampling only)")
    parser.add_argument("--max-new-tokens", type=int,
                        help="GSM8K: cap on generated tokens (default: the task's 256, as in the paper's setup)")
    parser.add_argument("--label", help="method name in reports (default: derived from the Bitune config)")
    parser.add_argument("--output", metavar="FILE|DIR",
                        help=f"result JSON file, or a folder to write {RESULT_FILE} into (default: next to the "
                             "checkpoint's final/ folder, i.e. the run folder; with --model: print only)")
    add_threads_option(parser)


def output_path(args: argparse.Namespace) -> Path | None:
    if args.output is not None:
        out = Path(check_named(args.output, "--output"))
        return out if out.suffix == ".json" else out / RESULT_FILE
    if args.checkpoint:
        ckpt = Path(args.checkpoint).resolve()
        return (ckpt.parent if ckpt.name == "final" else ckpt) / RESULT_FILE
    return None


def eval_argv(args: argparse.Namespace) -> list[str]:
    """The ``bitune eval`` arguments each launched process runs with (everything but ``--num-processes``)."""
    argv = ["eval", "--tasks", args.tasks]
    for flag in ("checkpoint", "model", "base", "split", "limit", "batch_size", "device", "dtype", "prompt_passes", "seed",
                 "max_new_tokens", "label", "output", "template", "threads"):
        value = getattr(args, flag, None)
        if value is not None:
            argv += [f"--{flag.replace('_', '-')}", str(value)]
    return argv + (["--no-merge"] if args.no_merge else []) + (["--merge-bidir"] if args.merge_bidir else [])


def is_result(record) -> bool:
    """Whether ``record`` is an evaluation result (``"schema": "bitune-eval/..."``): the one kind of file an
    ``--output`` replaces (re-evaluating a run updates its record)."""
    return isinstance(record, dict) and str(record.get("schema", "")).startswith(SCHEMA.split("/")[0] + "/")


def check_processes(num_processes: int, limit: int | None) -> None:
    """Every process must get work: each scores every N-th question of a task, and a process with none would
    leave the others waiting for it at the gather (a crash of the whole job, not an idle process).

    Raises:
        BituneError: fewer than 1 process, or more processes than ``--limit`` questions per task.
    """
    if num_processes < 1:
        raise BituneError(f"--num-processes must be >= 1, got {num_processes}")
    if limit is not None and 1 <= limit < num_processes:
        raise BituneError(f"--num-processes {num_processes} is more than --limit {limit} questions per task: every "
                          f"process needs a question; use --num-processes {limit} or fewer")


def run(args: argparse.Namespace) -> int:
    from ..eval.evaluate import check_eval_options, evaluate_run  # lm-eval (the eval extra), before anything else

    check_processes(args.num_processes, args.limit)
    if args.checkpoint is not None:
        check_named(args.checkpoint, "--checkpoint")  # "" would be the current folder, searched below
    out = output_path(args)
    if out is not None:  # before the evaluation, not after it; eval.json may sit in the checkpoint, nothing else
        ckpt_files = [p for p in Path(args.checkpoint).rglob("*") if p.is_file()] if args.checkpoint else []
        keep = tuple(("a file of the checkpoint", p) for p in ckpt_files if p.name != RESULT_FILE)
        check_output_file(out, "--output", keep=(*keep, *model_inputs(args)[1:]))  # and --model/--base folders
        check_replaces_own(out, "--output", "an evaluation result", is_result)
    card = card_to_refresh(args.checkpoint, out)  # before the evaluation: it never fails after it
    if args.num_processes > 1:  # the launched processes evaluate; the first writes the result and the card
        from .launcher import launch

        check_eval_options(args.limit, args.batch_size, args.max_new_tokens, args.seed, args.label)
        return launch(args.num_processes, eval_argv(args))  # a failure: each process's error shown once, above
    record = evaluate_run(checkpoint=args.checkpoint, model_name=args.model, base=args.base, tasks=args.tasks,
                          limit=args.limit, batch_size=args.batch_size, device=args.device, dtype=args.dtype,
                          seed=args.seed, label=args.label, max_new_tokens=args.max_new_tokens, output=out,
                          template=args.template, prompt_passes=args.prompt_passes, merge=merge_mode(args),
                          split=args.split)
    if card and record is not None:  # the card shows the result just written, by the process that wrote it
        from ..modelcard import refresh_evaluation

        refresh_evaluation(args.checkpoint)
    return 0


def card_to_refresh(checkpoint: str | None, out: Path | None) -> bool:
    """Whether the checkpoint's model card is to show the result written to ``out``: only when ``out`` is the
    result the card reads (``eval.json`` in the checkpoint or, for a run's ``final/``, beside it), and the card is
    bitune's and may be written. A card that may not (a read-only checkpoint) is left as it is, said here, before
    the evaluation: the user asked for the result, not for the card."""
    if not checkpoint or out is None:
        return False
    from ..modelcard import CARD_FILE, is_ours

    folder = Path(checkpoint)
    if out.resolve() not in {(folder / RESULT_FILE).resolve(), (folder.parent / RESULT_FILE).resolve()}:
        return False
    card = folder / CARD_FILE
    if not is_ours(card):
        return False
    if not (os.access(card, os.W_OK) and os.access(folder, os.W_OK | os.X_OK)):
        print(f"bitune eval: {card} is not writable: its evaluation section is left as it is", file=sys.stderr)
        return False
    return True
