"""``bitune bench eval``: multiple-choice scoring speed, the ``bitune`` model type against lm-eval's ``hf``.

All score the same lm-eval requests of one task (every choice of the first ``--limit`` questions) with the same
base weights, tokenizer and batch size: lm-eval's ``hf`` (context and choice concatenated per row), ``bitune``
with the ``pretrained`` variant (one prompt pass per question, every choice scored from its cache) and ``bitune``
with a two-pass Bitune model (a ``--checkpoint``, or the base model wrapped as Bitune with fresh adapters: the
same compute), its causal weights merged as ``bitune eval`` merges them. Rounds are interleaved, the order
reversed every round, and the machine's load average is recorded with the result, so a busy machine shows.
Reports questions per second for each, the ratios to ``hf``, the largest score difference of ``pretrained`` to
``hf`` (a parity check on a real model), and the positions each one's forwards computed (padding included):
``hf``'s over each one's is the speed ratio that computing fewer positions alone would give at equal cost per
position (a prompt position of ``bitune`` computes no logits, so a little more is possible). The token floors
count real tokens instead (:func:`token_floors`).
"""

from __future__ import annotations

import json
import os

import torch
from lm_eval.models.huggingface import HFLM

from ..config import BituneConfig, merge_choice
from ..errors import BituneError
from ..eval.lm import BituneLM
from ..eval.tasks import make_task
from ..hub import DEFAULT_MODEL
from ..loading import load_bitune
from ..model import BituneModel
from .helpers import check_checkpoint, interleaved, timed


def time_loglikelihood(model_name: str = DEFAULT_MODEL, task: str = "piqa", limit: int = 20, batch_size: int = 8,
                       device: str = "cpu", rounds: int = 2, checkpoint: str | None = None,
                       merge: bool | str = True) -> dict:
    """Time ``loglikelihood`` over one task's requests for ``hf``, ``pretrained`` and ``bitune``; the fastest of
    ``rounds`` interleaved rounds counts. ``merge`` is the two-pass model's (``load_bitune``'s: True merges the
    causal weights, ``"both"`` the bidir ones too, into a copy).

    Raises:
        BituneError: the task is not multiple-choice, or ``checkpoint`` is not a Bitune-variant checkpoint of
            ``model_name`` (before any model loads).
    """
    t = check_inputs(model_name, task, checkpoint)
    model, tokenizer = load_bitune(model=model_name, device=device)
    if checkpoint:
        two_pass, _ = load_bitune(checkpoint=checkpoint, device=device, merge=merge)
    else:
        base, _ = load_bitune(model=model_name, device=device)
        two_pass = BituneModel.wrap(base.weights.base, BituneConfig(variant="bitune")).eval()
        if merge:
            two_pass.merge(bidir_copy=merge == "both")
    t.build_all_requests(limit=limit)
    requests = [inst for inst in t.instances]
    questions = len({inst.doc_id for inst in requests})
    lms = {"hf": HFLM(pretrained=model.weights.base, tokenizer=tokenizer, batch_size=batch_size, device=device),
           "pretrained": BituneLM(model=model, tokenizer=tokenizer, batch_size=batch_size),
           "bitune": BituneLM(model=two_pass, tokenizer=tokenizer, batch_size=batch_size)}
    out = {"model": model_name, "task": task, "questions": questions, "requests": len(requests),
           "batch_size": batch_size, "device": device, "threads": torch.get_num_threads(), "rounds": rounds,
           "checkpoint": checkpoint, "bitune_merge": {True: "causal", "both": "both", False: "none"}[merge],
           "load_average_before": [round(x, 2) for x in os.getloadavg()]}
    for lm in lms.values():
        lm.loglikelihood(requests[: min(len(requests), batch_size)], disable_tqdm=True)  # warm-up
    positions = dict.fromkeys(lms, 0)  # positions the forwards of each one's first round computed
    counting = [None]

    def count(module, args, kwargs):
        if counting[0] is not None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            positions[counting[0]] += (ids if ids is not None else kwargs["inputs_embeds"][..., 0]).numel()

    hooks = [m.weights.base.get_decoder().register_forward_pre_hook(count, with_kwargs=True)
             for m in (model, two_pass)]  # hf and pretrained share the first
    times: dict[str, list[float]] = {name: [] for name in lms}
    scores = {}
    clock = torch.device(device)
    for r in range(rounds):
        for name in interleaved(lms, r):
            def score(name=name):
                scores[name] = lms[name].loglikelihood(requests, disable_tqdm=True)
            counting[0] = name if r == 0 else None
            times[name].append(timed(score, clock))
    counting[0] = None
    for hook in hooks:
        hook.remove()
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    for name, ts in times.items():
        out[f"{name}_s"] = [round(t, 3) for t in ts]
        out[f"{name}_questions_per_s"] = round(questions / min(ts), 3)
    for name in ("pretrained", "bitune"):
        out[f"{name}_over_hf"] = round(min(times["hf"]) / min(times[name]), 3)
    out["positions"] = positions
    out.update(token_floors(lms["pretrained"], requests))
    for name in ("pretrained", "bitune"):
        out[f"{name}_position_ratio"] = round(positions["hf"] / positions[name], 3)
        out[f"{name}_of_token_floor"] = round(out[f"{name}_over_hf"] / out[f"{name}_token_floor"], 3)
    out["max_abs_logprob_diff"] = max(abs(a[0] - b[0]) for a, b in zip(scores["pretrained"], scores["hf"]))
    out["greedy_agree"] = all(a[1] == b[1] for a, b in zip(scores["pretrained"], scores["hf"]))
    return out


def check_inputs(model_name: str, task: str, checkpoint: str | None):
    """What the benchmark reads, checked before a model loads: ``checkpoint`` (the two-pass row: a Bitune variant
    trained on ``model_name``, as ``bench serve`` requires) and ``task``, whose requests must be log-likelihoods of
    choices (a generation task such as gsm8k has none to score).

    Returns:
        The task object.

    Raises:
        BituneError: naming ``--checkpoint`` or ``--task`` and the problem.
    """
    if checkpoint:
        check_checkpoint("--checkpoint", checkpoint, model_name)
    t = make_task(task)
    if t.OUTPUT_TYPE != "multiple_choice":
        raise BituneError(f"--task {task} is a {t.OUTPUT_TYPE} task: bench eval times multiple-choice scoring "
                          "(log-likelihoods of the choices); give a multiple-choice task, e.g. piqa or arc_easy")
    return t


def token_floors(lm: BituneLM, requests) -> dict:
    """Real tokens (no padding) a forward must compute for ``requests``: ``hf`` reads context + choice - 1 per
    request; reading each context once reads it without its last token, and the answer pass computes that token
    once per context and every choice token but the last (two-pass Bitune reads each context twice). Their ratios
    are the speed ratios at equal cost per token."""
    contexts: dict[tuple[int, ...], list[int]] = {}
    hf = 0
    for inst in requests:
        ctx, cont = lm._fit(*lm._encode_pair(*inst.args))
        hf += len(ctx) + len(cont) - 1
        contexts.setdefault(tuple(ctx), []).append(len(cont))
    prompt = sum(len(ctx) - 1 for ctx in contexts)
    answer = sum(1 + sum(n - 1 for n in conts) for conts in contexts.values())
    return {"hf_tokens": hf, "prompt_tokens": prompt, "answer_tokens": answer,
            "pretrained_token_floor": round(hf / (prompt + answer), 3),
            "bitune_token_floor": round(hf / (2 * prompt + answer), 3)}


def bench_eval(args) -> dict:
    """``bitune bench eval``: check the counts, time, print the record as JSON; return it."""
    for flag in ("limit", "batch_size", "rounds"):
        if getattr(args, flag) < 1:
            raise ValueError(f"bench eval needs --{flag.replace('_', '-')} >= 1")
    result = time_loglikelihood(args.model, args.task, args.limit, args.batch_size, args.device, args.rounds,
                                args.checkpoint, merge_choice(args.no_merge, args.merge_bidir))
    print(json.dumps(result, indent=2))
    return result
