"""``bitune bench serve``: servers under load, side by side in one run.

Every server runs as its own process on 127.0.0.1 (``bitune serve``, or ``transformers serve
--continuous-batching`` for the plain-model anchor). The servers compared with each other are up together (the
two Bitune ones and LoRA, then the base model and transformers serve) and loaded in turn, round by round, the
order reversed every other round, so machine drift hits all alike; ratios are taken per round, then their
median. A load is N clients each sending M streamed ``/v1/completions`` requests one after another: prompts of
exactly P tokens (each request's its own, never sent before in the run: :class:`Prompts`) and exactly A generated tokens (end tokens ignored: ``ignore_eos`` here,
a ``generation_config`` without eos for transformers). Reported per server: generated tokens/s and requests/s
over the load's wall time, time to first token and latency p50 / p99, and the CPU time the server process
(threads and children included) spent on the load per generated token: on a CPU that is the cost of a token,
which other work on the machine inflates less than it does wall times.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BituneError
from .helpers import check_checkpoint, interleaved, shown

TEXT = ("The history of science is the study of the development of science and scientific knowledge, including "
        "both the natural and social sciences. Science is a body of empirical, theoretical, and practical "
        "knowledge about the natural world, produced by scientists who emphasize the observation, explanation, "
        "and prediction of real-world phenomena. Early roots of science can be traced to Ancient Egypt and "
        "Mesopotamia in around 3000 to 1200 BCE. Their contributions to mathematics, astronomy, and medicine "
        "entered and shaped Greek natural philosophy of classical antiquity, whereby formal attempts were made "
        "to provide explanations of events in the physical world based on natural causes. ")


@dataclass
class Server:
    """One server process under test."""

    name: str
    command: list[str]
    model: str
    fields: Callable[[int], dict]
    """The request fields that ask it for exactly n generated tokens (besides model, prompt and stream)."""
    port: int = 0
    process: subprocess.Popen | None = None
    log: object = None
    results: list[dict] = field(default_factory=list)
    compile_s: float | None = None
    """The startup compile time ``bitune serve --compile`` printed (read from its log once it stopped)."""


def prompts(tokenizer, n: int, length: int, start: int = 0) -> list[str]:
    """``n`` distinct texts that tokenize (with the tokenizer's special tokens, as both servers do) to exactly
    ``length`` tokens: text ``i`` (from ``start``) is the words of a fixed paragraph in an order of its own (seeded by
    ``i``), so no two share a beginning that a server's prefix cache could reuse."""
    words = TEXT.split()
    special = len(tokenizer("a")["input_ids"]) - len(tokenizer("a", add_special_tokens=False)["input_ids"])
    out = []
    for i in range(start, start + n):
        order = random.Random(i).sample(words, len(words))
        ids = tokenizer(" ".join(order * (1 + 2 * length // len(words))), add_special_tokens=False)["input_ids"]
        for take in range(length - special, 0, -1):  # decoding can merge tokens: shorten until it fits
            text = tokenizer.decode(ids[:take])
            if len(tokenizer(text)["input_ids"]) == length:
                out.append(text)
                break
        else:
            raise BituneError(f"cannot write a prompt of exactly {length} tokens with this tokenizer")
    return out


class Prompts:
    """Fresh prompts of exactly ``length`` tokens, none sent twice in a run: ``transformers serve`` caches the
    prompts it has read (prefix caching, in blocks of ``--cb-block-size`` tokens) and would read a repeated one
    (the same prompts every round, or every request of a client) from that cache, which is not the load a
    benchmark of distinct requests means to measure."""

    def __init__(self, tokenizer, length: int):
        self.tokenizer, self.length, self.used = tokenizer, length, 0

    def take(self, n: int) -> list[str]:
        out = prompts(self.tokenizer, n, self.length, self.used)
        self.used += n
        return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(server: Server, threads: int, logs: Path) -> None:
    server.port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false"}
    server.log = open(logs / f"{server.name}.log", "w")
    server.process = subprocess.Popen([*server.command, "--port", str(server.port)], env=env, stdout=server.log,
                                      stderr=subprocess.STDOUT)


def wait_ready(server: Server, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            server.log.flush()
            lines = [x.strip() for x in Path(server.log.name).read_text(errors="replace").splitlines() if x.strip()]
            why = next((x for x in reversed(lines) if " error: " in x), lines[-1] if lines else "no output")
            raise BituneError(f"server {server.name} exited with status {server.process.returncode}: {why}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise BituneError(f"server {server.name} did not start within {timeout:.0f} s")


def stop(server: Server) -> None:
    if server.process is not None and server.process.poll() is None:
        server.process.terminate()
        try:
            server.process.wait(30)
        except subprocess.TimeoutExpired:
            server.process.kill()
    if server.log is not None:
        server.log.close()


def compile_seconds(log: Path) -> float | None:
    """The compile time a ``bitune serve --compile`` log states ("compiled in 12.3 s"), else None."""
    import re

    found = re.search(r"compiled in ([0-9.]+) s", log.read_text(errors="replace")) if log.is_file() else None
    return float(found.group(1)) if found else None


def request(server: Server, prompt: str, new_tokens: int) -> dict:
    """One streamed completion; returns its start, first-token and end times and generated tokens."""
    body = {"model": server.model, "prompt": prompt, "stream": True, **server.fields(new_tokens)}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    start_time = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise BituneError(f"server {server.name} answered {response.status}: {response.read()[:300]!r}")
    first, tokens = None, None
    while line := response.readline():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if first is None and any(c.get("text") for c in chunk.get("choices", [])):
            first = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    conn.close()
    if tokens != new_tokens:
        raise BituneError(f"server {server.name} generated {tokens} tokens, asked for {new_tokens}")
    return {"start": start_time, "first": first if first is not None else end, "end": end, "tokens": tokens}


def cpu_seconds(process: subprocess.Popen) -> float:
    """User + system CPU seconds of a process so far: its threads, its live children and the children it has
    waited for."""
    import psutil

    proc = psutil.Process(process.pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:  # ended since the listing: its time is its parent's once waited for
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def load(server: Server, fresh: Prompts, clients: int, requests_per_client: int, new_tokens: int) -> dict:
    """N clients, each sending its requests (fresh prompts) one after another; the load's summary."""
    texts = [fresh.take(requests_per_client) for _ in range(clients)]  # before the clock starts
    results, errors = [], []
    cpu_before = cpu_seconds(server.process)

    def client(mine: list[str]) -> None:
        try:
            for text in mine:
                results.append(request(server, text, new_tokens))
        except Exception as e:  # reported below, after every client ended
            errors.append(e)

    threads = [threading.Thread(target=client, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    summary = summarize(results)
    summary["cpu_ms_per_token"] = 1000 * (cpu_seconds(server.process) - cpu_before) / sum(r["tokens"] for r in results)
    return summary


def summarize(results: list[dict]) -> dict:
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    ttft = sorted(r["first"] - r["start"] for r in results)
    latency = sorted(r["end"] - r["start"] for r in results)
    # Each stream's rate after its first token: the decoding steps alone, without the prompt reading (batched
    # streams share the steps, so this is a per-stream rate, not the server's).
    streams = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in results if r["tokens"] > 1 and r["end"] > r["first"]]
    return {"requests": len(results), "wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "stream_decode_tok_s": statistics.median(streams) if streams else float("nan"),
            "requests_per_s": len(results) / wall, "ttft_p50_s": statistics.median(ttft),
            "ttft_p99_s": _percentile(ttft, 0.99), "latency_p50_s": statistics.median(latency),
            "latency_p99_s": _percentile(latency, 0.99)}


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile of sorted ``values``."""
    pos = q * (len(values) - 1)
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


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
    summaries (:func:`summarize`): the request time is the base model's median latency, the extra prompt reading
    Bitune's median time to first token minus the base model's (never below 0). docs/benchmarks.md explains it."""
    extra = max(bitune["ttft_p50_s"] - base["ttft_p50_s"], 0.0)
    return base["latency_p50_s"] / (base["latency_p50_s"] + extra)


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


RATIO_NAMES = {
    "batching": "batching / batch 1", "bitune_vs_pretrained": "Bitune / base model",
    "bitune_vs_pretrained_bound": "Bitune / base model, the cost-model bound (base request time / (base request "
                                  "time + Bitune's extra prompt reading, from the TTFT))",
    "bitune_vs_lora": "Bitune / LoRA",
    "pretrained_vs_transformers": "base model / transformers serve",
    "bitune_ttft_vs_pretrained": "Bitune / base model, time to first token (p50)",
    "bitune_decode_vs_pretrained": "Bitune / base model, each stream's tokens/s after its first token",
    "bitune_unmerged_vs_pretrained": "Bitune unmerged (--no-merge) / base model",
    "lora_unmerged_vs_pretrained": "LoRA unmerged (--no-merge) / base model",
    "pretrained_vs_transformers_cpu": "base model / transformers serve, by CPU time per generated token",
    "bitune_vs_pretrained_cpu": "Bitune / base model, by CPU time per generated token",
    "pretrained_compiled_vs_transformers": "base model --compile / transformers serve",
    "bitune_compiled_vs_transformers": "Bitune --compile / transformers serve (serving the base model)",
    "bitune_compiled_bidir_vs_transformers": "Bitune --compile --merge-bidir / transformers serve (serving the base "
                                             "model)",
    "compiled_vs_eager": "base model --compile / base model",
    "bitune_compiled_vs_eager": "Bitune --compile / Bitune",
    "pretrained_ttft_vs_transformers": "base model / transformers serve, time to first token (p50)",
    "bitune_ttft_vs_transformers": "Bitune / transformers serve, time to first token (p50)"}
"""How :func:`render` names each ratio of the record."""
_TOKENS_PER_S = {"batching", "bitune_vs_pretrained", "bitune_vs_pretrained_bound", "bitune_vs_lora",
                 "pretrained_vs_transformers", "bitune_unmerged_vs_pretrained", "lora_unmerged_vs_pretrained",
                 "pretrained_compiled_vs_transformers", "bitune_compiled_vs_transformers",
                 "bitune_compiled_bidir_vs_transformers", "compiled_vs_eager", "bitune_compiled_vs_eager"}
"""The ratios of generated tokens/s."""


def render(record: dict) -> None:
    """Print a :func:`measure` record: the servers' table, the ratios (the targets they are judged against are
    stated in docs/benchmarks.md) and the machine's load."""
    from rich.console import Console
    from rich.table import Table

    r = record
    table = Table(title=f"bitune bench serve: {r['model']}, {r['dtype']}, {r['threads']} threads, {r['clients']} "
                        f"clients x {r['requests_per_client']} requests, prompt {r['prompt_tokens']} tokens, "
                        f"{r['new_tokens']} generated, median of {r['rounds']} rounds")
    for col in ("server", "tokens/s", "requests/s", "TTFT p50 s", "TTFT p99 s", "latency p50 s", "latency p99 s",
                "CPU ms / token"):
        table.add_column(col, justify="right")
    for name, r in record["servers"].items():
        table.add_row(name, f"{r['tokens_per_s']:.1f}", f"{r['requests_per_s']:.3f}", f"{r['ttft_p50_s']:.2f}",
                      f"{r['ttft_p99_s']:.2f}", f"{r['latency_p50_s']:.2f}", f"{r['latency_p99_s']:.2f}",
                      f"{r['cpu_ms_per_token']:.1f}")
    console = Console(width=120)
    console.print(table)
    for key, value in record["ratios"].items():
        if value is not None:
            console.print(f"{RATIO_NAMES[key]}: {value:.2f}x" + (" generated tokens/s" if key in _TOKENS_PER_S else ""))
    for name, seconds in record.get("compile_s", {}).items():
        console.print(f"{name}: the decoding step compiled at start in {seconds:.1f} s")
    load_before = record["load_average_before"]
    console.print(f"load average (1, 5, 15 min) before {load_before[0]:.1f}, {load_before[1]:.1f}, "
                  f"{load_before[2]:.1f}; after {record['load_average_after'][0]:.1f}")
