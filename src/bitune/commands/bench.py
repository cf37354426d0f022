"""``bitune bench``: the command line of the benchmarks in :mod:`bitune.bench`, one sub-verb per module.

``train``, ``generate``, ``data``, ``sharding``, ``decode``, ``prefill``, ``serve`` and ``eval`` each run
:mod:`bitune.bench.<what>` (imported only when it runs: this module loads no torch), print its table and, with
``--output``, write its record as JSON.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from ..config import METHODS
from ..files import check_output_file, check_replaces_own
from ..hub import DEFAULT_MODEL
from .options import add_merge_option

HELP = "benchmark training, generation and serving speed/memory against LoRA"
OUTPUT_HELP = ("also write the results as JSON here (an existing file is replaced only when it holds an earlier "
               "benchmark record)")


def configure(parser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    tr = sub.add_parser("train", help="training step time and peak memory, Bitune vs LoRA")
    tr.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    tr.add_argument("--lengths", default="64:64,256:64", help="comma-separated PROMPT:ANSWER token lengths")
    tr.add_argument("--batch-size", type=int, default=1, help="examples per step")
    tr.add_argument("--steps", type=int, default=3, help="timed steps per method and length (after 1 warm-up)")
    tr.add_argument("--output", default=None, help=OUTPUT_HELP)
    ge = sub.add_parser("generate", help="prefill a long prompt and generate N tokens (paper Table 4)")
    ge.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    ge.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (the paper: 2000 on a GPU)")
    ge.add_argument("--new-tokens", type=int, default=64, help="generated tokens (the paper: 2000 on a GPU)")
    ge.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported")
    ge.add_argument("--compile", action="store_true",
                    help="also time decoding compiled (torch.compile, static cache) for the base model and Bitune "
                         "(compiling takes minutes on CPU)")
    ge.add_argument("--output", default=None, help=OUTPUT_HELP)
    da = sub.add_parser("data", help="training throughput on a config's real data, Bitune vs LoRA")
    da.add_argument("--config", action="append", required=True, metavar="FILE.yaml",
                    help="training config (as for 'bitune train'; repeat to merge): its model, dataset, batch size")
    da.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a setting, e.g. --set batch_size=8")
    da.add_argument("--steps", type=int, default=6, help="timed optimizer steps per method (after 1 warm-up)")
    da.add_argument("--rounds", type=int, default=1,
                    help="times the same steps are timed, interleaved; the time ratio's median is reported")
    da.add_argument("--output", default=None, help=OUTPUT_HELP)
    sh = sub.add_parser("sharding", help="per-process parameter, gradient and AdamW bytes under DDP vs FSDP2, and "
                                         "activation bytes with checkpointing on vs off (starts N processes)")
    sh.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    sh.add_argument("--method", default="full", choices=sorted(METHODS),
                    help="Bitune's fine-tuning method (default full: two weight copies)")
    sh.add_argument("--num-processes", type=int, default=2, help="processes to shard over (gloo on CPU)")
    sh.add_argument("--prompt", type=int, default=64, help="prompt tokens of the random batch")
    sh.add_argument("--answer", type=int, default=64, help="answer tokens of the random batch")
    sh.add_argument("--batch-size", type=int, default=1, help="examples per process")
    sh.add_argument("--meta", action="store_true",
                    help="count static bytes on the meta device (no step): for models too large to replicate here")
    sh.add_argument("--output", default=None, help=OUTPUT_HELP)
    sh.add_argument("--threads", type=int, default=None, help="threads per process (default 1)")
    de = sub.add_parser("decode", help="one decoding step (decode_step, what the server batches) against the "
                                       "model's own forward on the same cache, with a profile of where the time goes")
    de.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    de.add_argument("--batch-sizes", default="1,8", help="comma-separated rows decoded together")
    de.add_argument("--context", type=int, default=128, help="cached tokens per row before the timed steps")
    de.add_argument("--steps", type=int, default=32, help="timed decoding steps per batch size (after 4 warm-up)")
    de.add_argument("--output", default=None, help=OUTPUT_HELP)
    pf = sub.add_parser("prefill", help="reading prompts: both passes batched into one forward vs one forward per "
                                         "pass, by prompt length and batch size, against the base model's forward")
    pf.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    pf.add_argument("--lengths", default="32,64,128,256,512", help="comma-separated prompt lengths (tokens)")
    pf.add_argument("--batch-sizes", default="1,8", help="comma-separated prompts read together")
    pf.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds; medians are reported")
    pf.add_argument("--output", default=None, help=OUTPUT_HELP)
    for p in (tr, ge, da, de, pf):
        p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                       help="model dtype; auto = bfloat16 on CUDA, float32 on CPU")
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    se = sub.add_parser("serve", help="bitune serve under load: batching, Bitune vs LoRA, vs transformers serve")
    se.description = ("N clients x M streamed requests against servers run side by side (each its own process, "
                      "all up at once, loaded in turn round by round): (a) a Bitune checkpoint batched vs "
                      "--max-batch-size 1, (b) Bitune vs LoRA checkpoints of the same base, (c) the base model "
                      "('pretrained') vs transformers serve --continuous-batching. Reports generated tokens/s, "
                      "requests/s, time to first token and latency p50/p99.")
    se.add_argument("--model", default=DEFAULT_MODEL, help="base model: built-in name, hub id or local folder")
    se.add_argument("--bitune", metavar="DIR", help="Bitune checkpoint on --model (default: fresh adapters, the "
                    "same compute as trained ones)")
    se.add_argument("--lora", metavar="DIR", help="LoRA checkpoint on --model (default: fresh adapters)")
    se.add_argument("--clients", type=int, default=8, help="concurrent clients")
    se.add_argument("--requests", type=int, default=2, help="requests per client per round, one after another")
    se.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens")
    se.add_argument("--new-tokens", type=int, default=64, help="generated tokens per request (end tokens ignored)")
    se.add_argument("--rounds", type=int, default=2, help="rounds over all servers; medians are reported")
    se.add_argument("--max-batch-size", type=int, default=16, help="the batched servers' --max-batch-size")
    se.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads of each server")
    se.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype")
    se.add_argument("--device", default=None, help="torch device of the servers (default: cpu)")
    se.add_argument("--no-transformers", action="store_true", help="skip the transformers serve comparison")
    se.add_argument("--compile", action="store_true", help="also serve the base model and Bitune with 'bitune serve "
                    "--compile' (compiled for --clients rows and --max-batch-size; their startup compile times "
                    "are recorded)")
    se.add_argument("--only", default=None, metavar="NAMES",
                    help="comma-separated servers to run (default: all; e.g. pretrained,transformers_serve)")
    se.add_argument("--output", default=None, help=OUTPUT_HELP)
    ev = sub.add_parser("eval", help="multiple-choice scoring speed: the bitune lm-eval model type vs lm-eval's hf")
    ev.description = ("Every choice of the first --limit questions of one task scored by lm-eval's hf, by the "
                      "bitune model type with the pretrained variant (one prompt pass per question) and with a "
                      "two-pass Bitune model, on the same base weights and batch size, in interleaved rounds. "
                      "Prints questions/s of each, the ratios to hf and the largest log-likelihood difference of "
                      "pretrained to hf, as JSON.")
    ev.add_argument("--model", default=DEFAULT_MODEL, help="base model: built-in name, hub id or local folder")
    ev.add_argument("--task", default="piqa", help="multiple-choice task, e.g. piqa, arc_easy")
    ev.add_argument("--limit", type=int, default=20, help="questions (each scored with all its choices)")
    ev.add_argument("--batch-size", type=int, default=8, help="contexts scored together")
    ev.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    ev.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ev.add_argument("--rounds", type=int, default=2, help="interleaved timed rounds; the fastest counts")
    ev.add_argument("--checkpoint", metavar="DIR", help="the two-pass Bitune model (default: --model with fresh "
                    "Bitune adapters, the same compute as trained ones)")
    add_merge_option(ev)  # the two-pass model's, as 'bitune eval' takes them
    ev.add_argument("--output", default=None, help=OUTPUT_HELP)


def inputs(args) -> tuple[tuple[str, str | None], ...]:
    """What a benchmark reads, as :func:`bitune.files.check_output_file`'s ``keep``: its local model folder and
    checkpoints, and for ``data`` the configs and the model and data file they name."""
    named = [(f"--{name}", getattr(args, name, None)) for name in ("model", "bitune", "lora", "checkpoint")]
    named += [("--config", path) for path in getattr(args, "config", None) or []]
    if args.bench == "data":
        from ..train import load_settings

        settings = load_settings(args.config, args.overrides)
        named += [("the config's model", settings.model), ("the config's dataset", settings.dataset)]
    return tuple((name, path) for name, path in named if path and Path(path).expanduser().exists())


def run(args) -> int:
    if args.threads is not None and args.bench not in ("sharding", "serve"):  # their servers or processes set their own
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads}: needs a positive number of threads")
        import torch

        torch.set_num_threads(args.threads)
    if args.output:  # before the benchmark runs
        check_output_file(args.output, "--output", keep=inputs(args))
        check_replaces_own(args.output, "--output", "a benchmark record (a JSON object with a 'model')",
                           lambda record: isinstance(record, dict) and "model" in record)
    module = importlib.import_module(f"bitune.bench.{args.bench}")  # bench_<what>(args) -> dict runs it
    from ..bench.helpers import write_json

    # a benchmark that measures in parts hands each finished one here as it ends (a record with "partial": true),
    # so a failure later loses nothing measured
    args.save_part = (lambda record: write_json(record, args.output)) if args.output else None
    result = getattr(module, f"bench_{args.bench}")(args)
    if args.output:
        write_json(result, args.output)
    return 0
