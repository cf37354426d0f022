"""``bitune bench serve``: servers under load, side by side in one run.

Every server runs as its own process on 127.0.0.1 (``bitune serve``, or ``transformers serve
--continuous-batching`` for the plain-model anchor; :mod:`.serve_processes`). The servers compared with each other
are up together (the two Bitune ones and LoRA, then the base model and transformers serve) and loaded in turn,
round by round, the order reversed every other round, so machine drift hits all alike; ratios are taken per round,
then their median. A load (:mod:`.serve_load`) is N clients each sending M streamed ``/v1/completions`` requests
one after another: prompts of exactly P tokens (each request's its own, never sent before in the run:
:class:`~.serve_load.Prompts`) and exactly A generated tokens (end tokens ignored: ``ignore_eos`` here, a
``generation_config`` without eos for transformers). Reported per server: generated tokens/s and requests/s over
the load's wall time, time to first token and latency p50 / p99, and the CPU time the server process (threads and
children included) spent on the load per generated token: on a CPU that is the cost of a token, which other work
on the machine inflates less than it does wall times. :mod:`.serve_render` prints the record.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..errors import BituneError
from .helpers import check_checkpoint, interleaved, shown
from .serve_load import Prompts, load
from .serve_processes import Server, compile_seconds, start, stop, wait_ready
from .serve_render import render


# ------------------------------------------------------------------------------------------------ the rounds
def run_servers(groups: list[list[Server]], fresh: Prompts, args,
                save: Callable[[dict[str, list[dict]]], None] = lambda per_round: None) -> dict[str, list[dict]]:
    """Group by group (the servers compared with each other, up at once; one group at a time bounds memory):
    start every server, warm each up, then ``args.rounds`` rounds of the load on each in turn; ``save`` gets every
    server's results so far after each load."""
    logs = Path(tempfile.mkdtemp(prefix="bitune-bench-serve-"))
    print(f"bitune bench serve: server logs in {logs}", file=sys.stderr)
    out = {}
    for servers in groups:
        try:
            for s in servers:
                start(s, args.threads, logs)
            for s in servers:
                wait_ready(s)
                load(s, fresh, args.clients, 1, min(args.new_tokens, 4))  # warm-up: the first request pays one-time costs
            for r in range(args.rounds):
                for s in interleaved(servers, r):
                    s.results.append(load(s, fresh, args.clients, args.requests, args.new_tokens))
                    print(f"bitune bench serve: round {r + 1}: {s.name}: {s.results[-1]['tokens_per_s']:.1f} "
                          f"tokens/s", file=sys.stderr)
                    save({**out, **{t.name: t.results for t in servers if t.results}})
        finally:
            for s in servers:
                stop(s)
                s.compile_s = compile_seconds(Path(s.log.name)) if s.log is not None else None
        out.update({s.name: s.results for s in servers})
    return out


# ------------------------------------------------------------------------------------------------ the command
def ours(name: str, source: list[str], args, batch: int, merge: bool | str = True, compile: bool = False,
         length: int | None = None) -> Server:
    """A ``bitune serve`` server; ``compile``: with ``--compile``, for the load's batch (every client at once) and
    --max-batch-size, its slots ``length`` positions long (default: one request's, and a little room)."""
    compiled = ["--compile", "--compile-buckets", str(min(args.clients, batch)), "--max-model-len",
                str(length or args.prompt_tokens + args.new_tokens + 8)] if compile else []
    command = [sys.executable, "-m", "bitune.cli", "serve", *source, "--served-model-name", "m", "--threads",
               str(args.threads), "--dtype", args.dtype, "--max-batch-size", str(batch), "--max-queue", "4096",
               "--log-level", "warning", *(["--device", args.device] if args.device else []),
               *{True: [], False: ["--no-merge"], "both": ["--merge-bidir"]}[merge], *compiled]
    return Server(name, command, "m", lambda n: {"max_tokens": n, "temperature": 0, "ignore_eos": True,
                                                "stream_options": {"include_usage": True}})


def transformers_server(folder: str, args) -> Server:
    blocks = 4 * args.clients * -(-(args.prompt_tokens + args.new_tokens) // 32)  # its paged cache, bounded
    command = [sys.executable, "-m", "transformers.cli.transformers", "serve", folder, "--continuous-batching",
               "--host", "127.0.0.1", "--device", args.device or "cpu", "--dtype", args.dtype, "--cb-block-size",
               "32", "--cb-num-blocks", str(blocks), "--log-level", "warning"]
    return Server("transformers_serve", command, folder,
                  lambda n: {"generation_config": json.dumps({"max_new_tokens": n, "do_sample": False})})


def checkpoints(args, work: Path) -> dict[str, str]:
    """The Bitune and LoRA checkpoints to serve: the ones given, else fresh ones on ``args.model`` (adapters as
    initialised: the same shapes, hence the same compute, as trained ones)."""
    from ..config import BituneConfig
    from ..hub import load_model
    from ..model import BituneModel

    out = {}
    for variant in ("bitune", "lora"):
        given = getattr(args, variant)
        if given:
            check_checkpoint(f"--{variant}", given, args.model, lora=variant == "lora")  # a row's name is what
            out[variant] = given  # it serves: a LoRA row of a Bitune checkpoint is no ratio
            continue
        base, _ = load_model(args.model)
        BituneModel.wrap(base, BituneConfig(variant=variant, base_model=args.model)).save_pretrained(work / variant)
        out[variant] = str(work / variant)
    return out


def bench_serve(args) -> dict:
    """``bitune bench serve``: measure (:func:`measure`), print (:func:`render`), return the record."""
    return shown(measure(args), render)


def wanted_servers(args) -> set[str]:
    """The servers to run: every one the options make (``--no-transformers`` leaves one out, ``--compile`` adds
    three), or those ``--only`` names, checked before any checkpoint is made or server starts.

    Raises:
        BituneError: ``--only`` names no server, or one that is not run.
    """
    names = ["bitune", "bitune_unmerged", "bitune_batch1", "lora", "lora_unmerged", "pretrained",
             *([] if args.no_transformers else ["transformers_serve"]),
             *(["bitune_compiled", "bitune_compiled_bidir", "pretrained_compiled"] if args.compile else [])]
    if args.only is None:
        return set(names)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(names))
    if not wanted or unknown:
        raise BituneError(f"--only {args.only!r}: " + (f"no server named {', '.join(unknown)}" if unknown else
                                                       "names no server") + f"; the servers are {', '.join(names)}")
    return set(wanted)


def measure(args) -> dict:
    """Run the comparisons; return the record (written as JSON with ``--output``).

    Raises:
        ModuleNotFoundError: the serve extra is missing (:mod:`bitune.cli` names it in one line), before any model
            loads: its servers would fail only after the load.
    """
    for package in ("fastapi", "uvicorn"):
        if importlib.util.find_spec(package) is None:
            raise ModuleNotFoundError(f"No module named {package!r}", name=package)
    from transformers import AutoConfig, AutoTokenizer

    from ..hub import resolve_device, resolve_model

    for flag in ("clients", "requests", "rounds", "threads", "max_batch_size"):
        if getattr(args, flag) < 1:
            raise BituneError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.prompt_tokens < 2 or args.new_tokens < 1:
        raise BituneError("--prompt-tokens must be >= 2 and --new-tokens >= 1")
    resolve_device(args.device)  # a bad --device fails here, not in each server's log
    folder = resolve_model(args.model)
    positions = AutoConfig.from_pretrained(folder).get_text_config().max_position_embeddings
    if args.prompt_tokens + args.new_tokens > positions:
        raise BituneError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} do not fit the "
                          f"model's {positions} positions")
    wanted = wanted_servers(args)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    fresh = Prompts(tokenizer, args.prompt_tokens)
    fresh.take(1)  # a prompt of exactly --prompt-tokens can be written (else one error now)
    load_before = os.getloadavg()

    def save(per_round: dict[str, list[dict]]) -> None:  # each finished load, as it ends: nothing is lost
        if getattr(args, "save_part", None) is not None:
            args.save_part({"model": args.model, "partial": True, "per_round": per_round})

    with tempfile.TemporaryDirectory(prefix="bitune-bench-serve-") as work:
        ckpts = checkpoints(args, Path(work))
        bitune, lora, batch = ["--checkpoint", ckpts["bitune"]], ["--checkpoint", ckpts["lora"]], args.max_batch_size
        servers = [ours("bitune", bitune, args, batch), ours("bitune_unmerged", bitune, args, batch, merge=False),
                   ours("bitune_batch1", bitune, args, 1), ours("lora", lora, args, batch),
                   ours("lora_unmerged", lora, args, batch, merge=False),
                   ours("pretrained", ["--model", args.model], args, batch),
                   *([] if args.no_transformers else [transformers_server(folder, args)])]
        if args.compile:  # a request's positions, a little room for the tokenizer, within the model's
            length = min(args.prompt_tokens + args.new_tokens + 8, positions)
            servers += [ours("bitune_compiled", bitune, args, batch, compile=True, length=length),
                        ours("bitune_compiled_bidir", bitune, args, batch, merge="both", compile=True, length=length),
                        ours("pretrained_compiled", ["--model", args.model], args, batch, compile=True,
                             length=length)]
        servers = [s for s in servers if s.name in wanted]
        rounds = run_servers([servers], fresh, args, save)
        compile_s = {s.name: s.compile_s for s in servers if s.compile_s is not None}
    rows = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
            for name, results in rounds.items()}

    def ratio(a: str, b: str, key: str = "tokens_per_s") -> float | None:  # per round, then the median
        pairs = [(x[key], y[key]) for x, y in zip(rounds.get(a, []), rounds.get(b, []))
                 if math.isfinite(x[key]) and math.isfinite(y[key]) and y[key] > 0]  # a load too short to time: none
        return statistics.median(x / y for x, y in pairs) if pairs else None

    ratios = {"batching": ratio("bitune", "bitune_batch1"), "bitune_vs_pretrained": ratio("bitune", "pretrained"),
              "bitune_vs_pretrained_bound": _median_or_none([cost_model_bound(b, p) for b, p in
                                                            zip(rounds.get("bitune", []), rounds.get("pretrained", []))]),
              "bitune_vs_lora": ratio("bitune", "lora"),
              "pretrained_vs_transformers": ratio("pretrained", "transformers_serve"),
              "bitune_ttft_vs_pretrained": ratio("bitune", "pretrained", "ttft_p50_s"),
              "bitune_decode_vs_pretrained": ratio("bitune", "pretrained", "stream_decode_tok_s"),
              # CPU per generated token, the other server's over ours: how much cheaper our tokens are
              "pretrained_vs_transformers_cpu": ratio("transformers_serve", "pretrained", "cpu_ms_per_token"),
              "bitune_vs_pretrained_cpu": ratio("pretrained", "bitune", "cpu_ms_per_token"),
              "bitune_unmerged_vs_pretrained": ratio("bitune_unmerged", "pretrained"),
              "lora_unmerged_vs_pretrained": ratio("lora_unmerged", "pretrained"),
              "pretrained_compiled_vs_transformers": ratio("pretrained_compiled", "transformers_serve"),
              "bitune_compiled_vs_transformers": ratio("bitune_compiled", "transformers_serve"),
              "bitune_compiled_bidir_vs_transformers": ratio("bitune_compiled_bidir", "transformers_serve"),
              "compiled_vs_eager": ratio("pretrained_compiled", "pretrained"),
              "bitune_compiled_vs_eager": ratio("bitune_compiled", "bitune"),
              "pretrained_ttft_vs_transformers": ratio("pretrained", "transformers_serve", "ttft_p50_s"),
              "bitune_ttft_vs_transformers": ratio("bitune", "transformers_serve", "ttft_p50_s")}
    record = {"model": args.model, "device": args.device or "cpu", "dtype": args.dtype, "threads": args.threads,
              "clients": args.clients, "requests_per_client": args.requests, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "rounds": args.rounds, "max_batch_size": args.max_batch_size,
              "checkpoints": {k: (v if getattr(args, k) else "fresh adapters (untrained)") for k, v in ckpts.items()},
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "servers": rows, "per_round": rounds, "ratios": ratios, "compile_s": compile_s}
    return record


def cost_model_bound(bitune: dict, base: dict) -> float:
    """What Bitune / base model generated tokens/s can be at best when Bitune costs the base model's request plus
    one more prompt pass: base request time / (base request time + Bitune's extra prompt reading), from one round's
    summaries (:func:`~.serve_load.summarize`): the request time is the base model's median latency, the extra
    prompt reading Bitune's median time to first token minus the base model's (never below 0). docs/benchmarks.md
    explains it."""
    extra = max(bitune["ttft_p50_s"] - base["ttft_p50_s"], 0.0)
    return base["latency_p50_s"] / (base["latency_p50_s"] + extra)


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


