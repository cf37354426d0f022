"""``bitune bench``: training and generation speed and memory of Bitune against the LoRA baseline.

``train`` times full optimizer steps of Bitune (fused, batched and sequential passes) and the LoRA baseline on
the same model, batch and lengths, interleaving them step by step so machine drift hits all alike, and prints
each ratio next to the FLOP ratio (2P + A) / (P + A), the floor of a perfect implementation (paper A.4).
``generate`` reproduces the paper's inference table (section 3.4): prefill a long prompt, generate N tokens;
a streamer timestamps every new token, so prefill time and decode rate come from the same call.
``serve`` loads ``bitune serve`` (and ``transformers serve``) with concurrent clients (:mod:`bitune.serve.bench`).
Peak memory is each model's parameters + gradients + Adam moments, plus what a step adds: on CUDA the
allocator's peak above the memory allocated before the step, on CPU the tensors autograd saves for backward
(counted by storage), the part that differs between methods.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table

from ..config import METHODS, BituneConfig
from ..data.collate import Collator, pad_id
from ..data.sampling import grouped_order, padding_share
from ..files import check_output_file, write_text_atomic
from ..hub import DEFAULT_MODEL, load_model
from ..model import BituneModel
from ..train import load_settings
from ..train.recipe import load_data

HELP = "benchmark training, generation and serving speed/memory against LoRA"


def configure(parser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="WHAT", required=True)
    tr = sub.add_parser("train", help="training step time and peak memory, Bitune vs LoRA")
    tr.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    tr.add_argument("--lengths", default="64:64,256:64", help="comma-separated PROMPT:ANSWER token lengths")
    tr.add_argument("--batch-size", type=int, default=1, help="examples per step")
    tr.add_argument("--steps", type=int, default=3, help="timed steps per method and length (after 1 warm-up)")
    tr.add_argument("--output", default=None, help="also write the results as JSON here")
    ge = sub.add_parser("generate", help="prefill a long prompt and generate N tokens (paper Table 4)")
    ge.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    ge.add_argument("--prompt-tokens", type=int, default=512, help="prompt length (the paper: 2000 on a GPU)")
    ge.add_argument("--new-tokens", type=int, default=64, help="generated tokens (the paper: 2000 on a GPU)")
    ge.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is reported")
    ge.add_argument("--output", default=None, help="also write the results as JSON here")
    da = sub.add_parser("data", help="training throughput on a config's real data, Bitune vs LoRA")
    da.add_argument("--config", action="append", required=True, metavar="FILE.yaml",
                    help="training config (as for 'bitune train'; repeat to merge): its model, dataset, batch size")
    da.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a setting, e.g. --set batch_size=8")
    da.add_argument("--steps", type=int, default=6, help="timed optimizer steps per method (after 1 warm-up)")
    da.add_argument("--rounds", type=int, default=1,
                    help="times the same steps are timed, interleaved; the time ratio's median is reported")
    da.add_argument("--output", default=None, help="also write the results as JSON here")
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
    sh.add_argument("--output", default=None, help="also write the results as JSON here")
    sh.add_argument("--threads", type=int, default=None, help="threads per process (default 1)")
    de = sub.add_parser("decode", help="one decoding step (decode_step, what the server batches) against the "
                                       "model's own forward on the same cache, with a profile of where the time goes")
    de.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    de.add_argument("--batch-sizes", default="1,8", help="comma-separated rows decoded together")
    de.add_argument("--context", type=int, default=128, help="cached tokens per row before the timed steps")
    de.add_argument("--steps", type=int, default=32, help="timed decoding steps per batch size (after 4 warm-up)")
    de.add_argument("--output", default=None, help="also write the results as JSON here")
    pf = sub.add_parser("prefill", help="reading prompts: both passes batched into one forward vs one forward per "
                                         "pass, by prompt length and batch size, against the base model's forward")
    pf.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, hub id or local folder")
    pf.add_argument("--lengths", default="32,64,128,256,512", help="comma-separated prompt lengths (tokens)")
    pf.add_argument("--batch-sizes", default="1,8", help="comma-separated prompts read together")
    pf.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds; medians are reported")
    pf.add_argument("--output", default=None, help="also write the results as JSON here")
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
    se.add_argument("--output", default=None, help="also write the results as JSON here")


def run(args) -> int:
    if args.bench == "generate" and (args.new_tokens < 2 or args.prompt_tokens < 2 or args.repeats < 1):
        raise ValueError("bench generate needs --prompt-tokens >= 2, --new-tokens >= 2 and --repeats >= 1")
    if args.bench == "train" and (args.steps < 1 or args.batch_size < 1):
        raise ValueError("bench train needs --steps >= 1 and --batch-size >= 1")
    if args.threads is not None and args.bench not in ("sharding", "serve"):  # their servers or processes set their own
        if args.threads < 1:
            raise ValueError(f"--threads {args.threads}: needs a positive number of threads")
        torch.set_num_threads(args.threads)
    if args.bench == "sharding" and (args.prompt < 2 or args.answer < 1 or args.batch_size < 1):
        raise ValueError("bench sharding needs --prompt >= 2, --answer >= 1 and --batch-size >= 1")
    if args.bench == "decode" and (args.steps < 1 or args.context < 2):
        raise ValueError("bench decode needs --steps >= 1 and --context >= 2")
    if args.bench == "data" and (args.steps < 1 or args.rounds < 1):
        raise ValueError("bench data needs --steps >= 1 and --rounds >= 1")
    if args.bench == "prefill" and args.rounds < 1:
        raise ValueError("bench prefill needs --rounds >= 1")
    if args.output:
        check_output_file(args.output, "--output")  # before the benchmark runs
    if args.bench == "sharding":
        from .bench_sharding import bench_sharding

        result = bench_sharding(args)
    elif args.bench == "serve":
        from ..serve.bench import bench_serve  # servers and HTTP clients: only for this benchmark

        result = bench_serve(args)
    else:
        result = {"train": bench_train, "generate": bench_generate, "data": bench_data,
                  "decode": bench_decode, "prefill": bench_prefill}[args.bench](args)
    if args.output:
        write_text_atomic(Path(args.output), json.dumps(result, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------ helpers
def _device_dtype(name: str) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, name)


def _build(model_name: str, variant: str, device, dtype, **kw):
    base, tokenizer = load_model(model_name, dtype=dtype)
    model = BituneModel.wrap(base.to(device), BituneConfig(variant=variant, **kw))
    return model.train(), tokenizer


def _held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer a model holds, plus a merged Bitune model's bidir copies
    (DoRA, IA3)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    weights = getattr(model, "weights", None)
    for _, weight, bias in getattr(weights, "_bidir_merged", []):
        tensors.update({id(t): t for t in (weight, bias) if t is not None})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _random_batch(vocab: int, B: int, P: int, A: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 2)  # skip the special tokens at the start of most vocabularies
    prompt = torch.randint(low, vocab, (B, P), generator=g).to(device)
    answer = torch.randint(low, vocab, (B, A), generator=g).to(device)
    return prompt, torch.ones_like(prompt), answer, torch.ones_like(answer)


class _TokenClock:
    """A ``generate`` streamer that timestamps each new token: prefill = start to the first new token, decode
    rate = tokens after the first over the time since the first, all from the same call."""

    def __init__(self, device):
        self.device = device
        self.start = time.perf_counter()
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands the streamer the prompt
            self._prompt_seen = True
            return
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for backward during a forward."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        if not (isinstance(t, torch.nn.Parameter) or t.requires_grad and t.is_leaf):
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _step(model, opt, batch, device) -> tuple[float, int]:
    """One optimizer step; returns (seconds, peak bytes of this model's training).

    Peak bytes = weights + gradients + Adam moments of this model, plus what the step adds on top: on CUDA the
    allocator's peak above what was allocated before the step (so other models kept on the device for the
    side-by-side comparison do not count), on CPU the storages autograd saves for backward.
    """
    saved = _SavedBytes()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = model(*batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(model.trainable_parameters().values()), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=False)
    _sync(device)
    seconds = time.perf_counter() - start
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.trainable_parameters().values())
    step = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else saved.total
    return seconds, params + 3 * trainable + step


def bench_train(args) -> dict:
    device, dtype = _device_dtype(args.dtype)
    try:
        lengths = [(int(p), int(a)) for p, a in (pair.split(":") for pair in args.lengths.split(","))]
    except ValueError:
        raise ValueError(f"--lengths {args.lengths!r}: expected PROMPT:ANSWER pairs, e.g. 64:64,256:64") from None
    if any(p < 2 or a < 1 for p, a in lengths):
        raise ValueError(f"--lengths {args.lengths!r}: prompts need >= 2 tokens and answers >= 1")
    paths = ("fused", "batched", "sequential")
    lora = _build(args.model, "lora", device, dtype)[0]
    positions = lora.text_config.max_position_embeddings
    if any(p + a > positions for p, a in lengths):
        raise ValueError(f"--lengths {args.lengths!r}: prompt + answer must fit the model's {positions} positions")
    bitune = _build(args.model, "bitune", device, dtype)[0]  # one model, its passes run each of the three ways
    default = f"bitune_{bitune.forward_path()}"  # what prompt_passes="auto" trains with
    runs = {"lora": (lora, None), **{f"bitune_{p}": (bitune, p) for p in paths}}
    opts = {id(m): torch.optim.AdamW(m.trainable_parameters().values(), lr=1e-4) for m in (lora, bitune)}
    vocab = lora.text_config.vocab_size
    rows = []
    for P, A in lengths:
        batch = _random_batch(vocab, args.batch_size, P, A, device)
        times = {name: [] for name in runs}
        peak = {name: 0 for name in runs}
        for i in range(args.steps + 1):
            for name, (model, passes) in runs.items():  # interleaved: drift hits every method alike
                if passes:
                    model.prompt_passes = passes
                seconds, mem = _step(model, opts[id(model)], batch, device)
                if i:
                    times[name].append(seconds)
                peak[name] = max(peak[name], mem)
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {"prompt": P, "answer": A, "flop_ratio": (2 * P + A) / (P + A),
               **{f"{n}_s": med[n] for n in runs}, **{f"{n}_peak_mb": peak[n] / 2**20 for n in runs}}
        for p in paths:
            row[f"time_ratio_{p}"] = med[f"bitune_{p}"] / med["lora"]
            row[f"memory_ratio_{p}"] = peak[f"bitune_{p}"] / peak["lora"]
        row["time_ratio"] = med[default] / med["lora"]
        row["memory_ratio"] = peak[default] / peak["lora"]
        rows.append(row)
    _print_train(rows, args, device, dtype, default)
    return {"device": str(device), "dtype": str(dtype), "model": args.model, "batch_size": args.batch_size,
            "threads": torch.get_num_threads(), "default": default.removeprefix("bitune_"), "rows": rows}


def _print_train(rows, args, device, dtype, default) -> None:
    default = default.removeprefix("bitune_")
    table = Table(title=f"Training step, {args.model}, {device.type} {str(dtype).removeprefix('torch.')}, "
                        f"batch {args.batch_size}, median of {args.steps} (default path: {default})")
    for col in ("P", "A", "path", "s / step", "/ LoRA", "FLOP ratio", "/ FLOP ratio", "memory / LoRA"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["prompt"]), str(r["answer"]), "LoRA", f"{r['lora_s']:.3f}", "1", "", "", "1")
        for p in ("fused", "batched", "sequential"):
            ratio = r[f"time_ratio_{p}"]
            table.add_row("", "", p + (" *" if p == default else ""), f"{r[f'bitune_{p}_s']:.3f}", f"{ratio:.2f}",
                          f"{r['flop_ratio']:.2f}", f"{ratio / r['flop_ratio']:.2f}", f"{r[f'memory_ratio_{p}']:.2f}")
    Console().print(table)
    Console().print("* what prompt_passes='auto' trains with. "
                    "Targets: time / FLOP ratio <= 1.05; memory <= 1.6 at P = A.")


@torch.no_grad()
def bench_generate(args) -> dict:
    """Prefill a prompt and decode ``new_tokens`` greedily, interleaved, for: the base model (transformers'
    ``generate`` on the plain model), LoRA merged and unmerged (PEFT's model, transformers' ``generate``), and
    Bitune merged (the default for inference; prompt read ``batched`` and ``sequential``) and unmerged. Ratios
    are against the base model."""
    device, dtype = _device_dtype(args.dtype)
    base_model, tokenizer = load_model(args.model, dtype=dtype)
    base_model = base_model.to(device).eval()
    base_copy = load_model(args.model, dtype=dtype)[0].to(device).eval()  # the control: same model, measured again
    bitune, _ = _build(args.model, "bitune", device, dtype)
    bitune_unmerged, _ = _build(args.model, "bitune", device, dtype)
    lora, _ = _build(args.model, "lora", device, dtype)
    lora_unmerged, _ = _build(args.model, "lora", device, dtype)
    for m in (bitune, bitune_unmerged, lora, lora_unmerged):
        m.eval()
    bitune.merge()
    lora.merge()
    prompt = _random_batch(bitune.text_config.vocab_size, 1, args.prompt_tokens, 1, device)[:2]
    gen = dict(eos_token_id=None, pad_token_id=tokenizer.pad_token_id, do_sample=False)

    def bitune_generate(model, passes):
        def run(n, streamer):
            model.prompt_passes = passes  # same weights, prompt read batched or sequentially
            return model.generate(*prompt, max_new_tokens=n, min_new_tokens=n, streamer=streamer, **gen)
        return run

    def hf_generate(model):  # transformers' own generate from scratch
        def run(n, streamer):
            return model.generate(input_ids=prompt[0], attention_mask=prompt[1], max_new_tokens=n,
                                  min_new_tokens=n, streamer=streamer, **gen)
        return run

    default = bitune.prefill_path(args.prompt_tokens - 1)  # what prompt_passes="auto" reads this prompt with
    other = "sequential" if default == "batched" else "batched"
    runners = {"base": hf_generate(base_model), "base_copy": hf_generate(base_copy),
               "lora": hf_generate(lora.weights.model),
               "lora_unmerged": hf_generate(lora_unmerged.weights.model),
               "bitune": bitune_generate(bitune, "auto"), f"bitune_{other}": bitune_generate(bitune, other),
               "bitune_unmerged": bitune_generate(bitune_unmerged, "auto")}
    for fn in runners.values():
        fn(2, None)  # warm-up
    samples = {name: [] for name in runners}
    for i in range(args.repeats):
        order = list(runners.items())
        for name, fn in order if i % 2 == 0 else order[::-1]:  # reversed every other round: no fixed position
            clock = _TokenClock(device)
            out = fn(args.new_tokens, clock)
            assert out.shape[-1] >= args.new_tokens and len(clock.times) == args.new_tokens
            samples[name].append(clock)
    rows = {}
    for name, clocks in samples.items():
        rows[name] = {"prefill_s": statistics.median(c.times[0] - c.start for c in clocks),
                      "decode_tok_s": statistics.median((len(c.times) - 1) / (c.times[-1] - c.times[0])
                                                        for c in clocks),
                      "total_s": statistics.median(c.times[-1] - c.start for c in clocks)}
    memory = {"base": _held_bytes(base_model), "lora": _held_bytes(lora), "lora_unmerged": _held_bytes(lora_unmerged),
              "bitune": _held_bytes(bitune), "bitune_unmerged": _held_bytes(bitune_unmerged)}
    summary = {"default": default, "memory_bytes": memory,
               "memory_ratio": {k: v / memory["base"] for k, v in memory.items() if k != "base"}}
    for name in runners:
        if name != "base":
            summary[name] = {"prefill_ratio": rows[name]["prefill_s"] / rows["base"]["prefill_s"],
                             "decode_ratio": rows[name]["decode_tok_s"] / rows["base"]["decode_tok_s"],
                             "total_ratio": rows[name]["total_s"] / rows["base"]["total_s"]}
    table = Table(title=f"Generation, {args.model}, {device.type}, prompt {args.prompt_tokens} tokens, "
                        f"{args.new_tokens} new tokens, median of {args.repeats}; ratios vs the base model")
    for col in ("model", "prefill s", "decode tok/s", "total s", "prefill x", "decode x"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        ratio = summary.get(name, {"prefill_ratio": 1.0, "decode_ratio": 1.0})
        table.add_row(name, f"{r['prefill_s']:.3f}", f"{r['decode_tok_s']:.2f}", f"{r['total_s']:.2f}",
                      f"{ratio['prefill_ratio']:.2f}", f"{ratio['decode_ratio']:.3f}")
    Console().print(table)
    Console().print(f"Memory held (parameters, buffers, merged copies) / base model: Bitune merged "
                    f"{summary['memory_ratio']['bitune']:.3f}x, unmerged {summary['memory_ratio']['bitune_unmerged']:.3f}x, "
                    f"LoRA merged {summary['memory_ratio']['lora']:.3f}x (target: Bitune merged <= 1.10x + the bidir "
                    f"difference).")
    Console().print(f"Noise floor: a second copy of the base model measured the same way: prefill "
                    f"{summary['base_copy']['prefill_ratio']:.2f}x, decode {summary['base_copy']['decode_ratio']:.3f}x "
                    "(a ratio closer to 1 than this is not resolved by this run).")
    Console().print(f"Bitune (merged, {default}) / base: prefill {summary['bitune']['prefill_ratio']:.2f}x (target "
                    f"<= 2.1x), decode tok/s {summary['bitune']['decode_ratio']:.3f}x (target >= 0.97x); LoRA "
                    f"(merged) decode {summary['lora']['decode_ratio']:.3f}x (target >= 0.97x). Unmerged: Bitune "
                    f"decode {summary['bitune_unmerged']['decode_ratio']:.3f}x, LoRA "
                    f"{summary['lora_unmerged']['decode_ratio']:.3f}x.")
    return {"device": str(device), "dtype": str(dtype), "model": args.model, "prompt_tokens": args.prompt_tokens,
            "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "rows": rows, **summary}


def _int_list(text: str, option: str, low: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} {text!r}: comma-separated integers") from None
    if not values or min(values) < low:
        raise ValueError(f"{option} {text!r}: every value must be >= {low}")
    return values


@torch.no_grad()
def bench_prefill(args) -> dict:
    """Read random prompts of each length and batch size with a merged Bitune model (fresh adapters: the same
    compute as trained ones), both prompt passes batched into one forward over 2B rows vs one forward per pass,
    interleaved round by round with the base model's own forward over the same prompts; reports the medians,
    the ratios and the path ``prompt_passes="auto"`` picks."""
    lengths = _int_list(args.lengths, "--lengths", 3)
    sizes = _int_list(args.batch_sizes, "--batch-sizes", 1)
    device, dtype = _device_dtype(args.dtype)
    base, _ = load_model(args.model, dtype=dtype)
    base = base.to(device).eval()
    model, _ = _build(args.model, "bitune", device, dtype)
    model.eval().merge()
    if max(lengths) > model.text_config.max_position_embeddings:
        raise ValueError(f"--lengths: {max(lengths)} passes the model's {model.text_config.max_position_embeddings} "
                         "positions")

    def timed(fn) -> float:
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - start

    rows = []
    for B in sizes:
        for P in lengths:
            ids, mask = _random_batch(model.text_config.vocab_size, B, P, 1, device)[:2]
            runs = {"base": lambda: base(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True,
                                         logits_to_keep=1)}
            for path in ("batched", "sequential"):
                def read(path=path):
                    model.prompt_passes = path
                    return model.prefill(ids, mask)
                runs[path] = read
            for fn in runs.values():
                fn()  # warm-up
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    times[name].append(timed(fn))
            model.prompt_passes = "auto"
            med = {name: statistics.median(t) for name, t in times.items()}
            auto = model.prefill_path(B * (P - 1))
            rows.append({"batch": B, "prompt_tokens": P, **{f"{k}_s": v for k, v in med.items()},
                         "batched_over_sequential": med["batched"] / med["sequential"], "auto": auto,
                         "auto_over_base": med[auto] / med["base"]})
    table = Table(title=f"Prefill, {args.model}, {device.type}, merged Bitune (fresh adapters), median of "
                        f"{args.rounds} interleaved rounds")
    for col in ("batch", "prompt", "base s", "batched s", "sequential s", "batched / sequential", "auto picks",
                "auto / base"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), str(r["prompt_tokens"]), f"{r['base_s']:.3f}", f"{r['batched_s']:.3f}",
                      f"{r['sequential_s']:.3f}", f"{r['batched_over_sequential']:.2f}", r["auto"],
                      f"{r['auto_over_base']:.2f}")
    Console().print(table)
    return {"device": str(device), "dtype": str(dtype), "model": args.model, "threads": torch.get_num_threads(),
            "rounds": args.rounds, "rows": rows}


# ----------------------------------------------------------------------------------------------- real data
PROFILE_GROUPS = {
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::_mkl_linear", "aten::linear", "aten::matmul"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                  "aten::_scaled_dot_product_attention_math", "aten::_softmax", "aten::softmax"),
}
"""Operator names (self time) counted as each group of the decoding profile; every other operator is "rest"."""


def bench_decode(args) -> dict:
    """Time ``BituneModel.decode_step`` (the base model as the ``pretrained`` variant: nothing but our wrapper
    around its forward) against the model's own forward on the same cache and inputs, per batch size, and
    profile the step with ``torch.profiler``: self time of matrix products, attention, and the rest."""
    from torch.profiler import ProfilerActivity, profile

    from ..passes import Prefill

    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes {args.batch_sizes!r}: comma-separated integers, e.g. 1,8") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes {args.batch_sizes!r}: every size must be >= 1")
    device, dtype = _device_dtype(args.dtype)
    base, _ = load_model(args.model, dtype=dtype)
    model = BituneModel(base.to(device).eval(), BituneConfig(variant="pretrained", base_model=args.model))
    positions = model.text_config.max_position_embeddings
    if args.context + args.steps + 8 > positions:
        raise ValueError(f"--context {args.context} + --steps {args.steps} pass the model's {positions} positions")
    pick = lambda logits: logits.argmax(-1)  # noqa: E731

    def fresh(B: int) -> Prefill:
        ids, mask = _random_batch(model.text_config.vocab_size, B, args.context, 1, device)[:2]
        return model.prefill(ids, mask)

    def ours(state, n):
        for _ in range(n):
            state = model.decode_step(state, pick)
        return state

    def floor(state, n):  # the forward decode_step wraps, with the inputs prepared once (no per-step bookkeeping)
        cache, token = state.cache, state.last_token
        T = state.mask.shape[1]
        mask = torch.ones(token.shape[0], T + n + 1, dtype=state.mask.dtype, device=device)
        for i in range(n):
            pos = torch.full_like(token, T + i)
            out = model.weights.base(input_ids=token, attention_mask=mask[:, :T + i + 1], position_ids=pos,
                                     cache=cache, use_cache=True, logits_to_keep=1)
            token = pick(out.logits[:, -1]).reshape(-1, 1)
        return state

    rows = {}
    with torch.no_grad():
        for B in sizes:
            times = {}
            for name, fn in (("decode_step", ours), ("model forward", floor)):
                state = fn(fresh(B), 4)  # warm-up
                _sync(device)
                t0 = time.perf_counter()
                fn(state, args.steps)
                _sync(device)
                times[name] = (time.perf_counter() - t0) / args.steps
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                ours(fresh(B), args.steps)
            groups = {g: 0.0 for g in (*PROFILE_GROUPS, "rest")}
            for event in prof.key_averages():
                group = next((g for g, names in PROFILE_GROUPS.items() if event.key in names), "rest")
                groups[group] += event.self_cpu_time_total
            total = sum(groups.values()) or 1.0
            rows[B] = {"step_ms": 1e3 * times["decode_step"], "forward_ms": 1e3 * times["model forward"],
                       "overhead": times["decode_step"] / times["model forward"],
                       "profile_share": {g: v / total for g, v in groups.items()},
                       "top_ops": [(e.key, e.self_cpu_time_total / total) for e in
                                   sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]]}
    table = Table(title=f"Decoding step, {args.model}, {device.type}, {torch.get_num_threads()} threads, "
                        f"context {args.context} tokens, {args.steps} steps")
    for col in ("rows", "decode_step ms", "model forward ms", "ours / forward", "matmuls", "attention", "rest"):
        table.add_column(col, justify="right")
    for B, r in rows.items():
        share = r["profile_share"]
        table.add_row(str(B), f"{r['step_ms']:.1f}", f"{r['forward_ms']:.1f}", f"{r['overhead']:.3f}",
                      f"{100 * share['matmuls']:.0f}%", f"{100 * share['attention']:.0f}%", f"{100 * share['rest']:.0f}%")
    Console().print(table)
    return {"model": args.model, "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(),
            "context": args.context, "steps": args.steps, "rows": {str(b): r for b, r in rows.items()}}


def bench_data(args) -> dict:
    """Optimizer steps of LoRA and Bitune on a training config's own data and batch size, interleaved.

    Batches come in the trainer's length-grouped order (the first ``steps + 1`` batches of epoch 0). Reports
    real (non-padding) prompt + answer tokens per second for each method, their time ratio next to the FLOP ratio
    of the same real lengths, sum(2 P + A) / sum(P + A), and the padding share of a whole epoch with and without
    grouping. With ``rounds`` > 1 the same steps are timed again (the models keep training) and the time ratio
    is the median of the rounds' ratios (each round's in ``round_time_ratios``); tokens/s pool all rounds.
    """
    settings = load_settings(args.config, args.overrides)
    device, dtype = _device_dtype(args.dtype)
    base, tokenizer = load_model(settings.model, dtype=dtype)
    data, _ = load_data(settings, tokenizer, settings.train_split, settings.limit)
    B = settings.batch_size
    lengths = [(len(s["prompt_ids"]), len(s["answer_ids"])) for s in data]
    g = torch.Generator().manual_seed(settings.seed)
    grouped = grouped_order(lengths, B, torch.Generator().manual_seed(settings.seed))
    shuffled = torch.randperm(len(data), generator=g).tolist()
    need = (args.steps + 1) * B
    if len(grouped) < need:
        raise ValueError(f"{settings.dataset} has {len(grouped)} examples; {args.steps} + 1 steps of batch {B} "
                         f"need {need}: lower --steps")
    collate = Collator(pad_id(tokenizer))
    batches = [[t.to(device) for t in collate([data[j] for j in grouped[i * B:(i + 1) * B]]).values()]
               for i in range(args.steps + 1)]
    models = {}
    for variant in ("lora", "bitune"):
        transformers.set_seed(settings.seed)
        config = BituneConfig(**{**settings.bitune.to_dict(), "variant": variant, "base_model": settings.model})
        fresh = base if not models else load_model(settings.model, dtype=dtype)[0]
        models[variant] = BituneModel.wrap(fresh.to(device), config, settings.prompt_passes).train()
    opts = {v: torch.optim.AdamW(m.trainable_parameters().values(), lr=1e-4) for v, m in models.items()}
    times = {v: [] for v in models}
    ratios = []
    for _ in range(args.rounds):
        round_times = {v: [] for v in models}
        for i, batch in enumerate(batches):
            for v, model in models.items():  # interleaved: drift hits both alike
                seconds, _ = _step(model, opts[v], batch, device)
                if i:
                    round_times[v].append(seconds)
        ratios.append(sum(round_times["bitune"]) / sum(round_times["lora"]))
        for v in models:
            times[v] += round_times[v]
    timed = [j for i in range(1, args.steps + 1) for j in grouped[i * B:(i + 1) * B]]
    real = sum(lengths[j][0] + lengths[j][1] for j in timed)
    flop = sum(2 * lengths[j][0] + lengths[j][1] for j in timed) / real
    total = {v: sum(t) for v, t in times.items()}
    result = {"model": settings.model, "dataset": settings.dataset, "batch_size": B, "steps": args.steps,
              "device": str(device), "dtype": str(dtype), "threads": torch.get_num_threads(),
              "real_tokens": real, "tokens_per_s": {v: args.rounds * real / total[v] for v in models},
              "rounds": args.rounds, "round_time_ratios": ratios, "time_ratio": statistics.median(ratios),
              "flop_ratio": flop,
              "padding_share": {"grouped": padding_share(lengths, grouped, B),
                                "random": padding_share(lengths, shuffled, B),
                                "grouped_one_pass": padding_share(lengths, grouped, B, prompt_reads=1),
                                "random_one_pass": padding_share(lengths, shuffled, B, prompt_reads=1)}}
    result["time_over_flop_ratio"] = result["time_ratio"] / flop
    pad = result["padding_share"]
    Console().print(
        f"{settings.model} on {settings.dataset}, batch {B}, {args.steps} steps each, {device.type}, "
        f"{result['threads']} threads: LoRA {result['tokens_per_s']['lora']:.0f} real tokens/s, Bitune "
        f"{result['tokens_per_s']['bitune']:.0f}; time ratio {result['time_ratio']:.2f}x (median of {args.rounds} round(s)), FLOP ratio of the real "
        f"lengths {flop:.2f}x, time / FLOP ratio {result['time_over_flop_ratio']:.2f} (target <= 1.05). Padding "
        f"share of an epoch (two prompt passes): grouped {100 * pad['grouped']:.1f}%, random "
        f"{100 * pad['random']:.1f}% (target <= 10% grouped).")
    return result
