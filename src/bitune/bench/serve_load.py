"""The load client of ``bitune bench serve``: N clients each sending M streamed ``/v1/completions`` requests one
after another, with prompts of exactly P tokens none sent twice (:class:`Prompts`), and the load's summary
(tokens/s, requests/s, time to first token and latency percentiles, CPU time per generated token)."""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time

from ..errors import BituneError
from .serve_processes import Server, cpu_seconds

TEXT = ("The history of science is the study of the development of science and scientific knowledge, including "
        "both the natural and social sciences. Science is a body of empirical, theoretical, and practical "
        "knowledge about the natural world, produced by scientists who emphasize the observation, explanation, "
        "and prediction of real-world phenomena. Early roots of science can be traced to Ancient Egypt and "
        "Mesopotamia in around 3000 to 1200 BCE. Their contributions to mathematics, astronomy, and medicine "
        "entered and shaped Greek natural philosophy of classical antiquity, whereby formal attempts were made "
        "to provide explanations of events in the physical world based on natural causes. ")
"""The paragraph whose words, in an order of their own, make every prompt."""


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
