"""How ``bitune bench serve`` prints its record: the servers' table, the ratios by name and the machine's load."""

from __future__ import annotations

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
