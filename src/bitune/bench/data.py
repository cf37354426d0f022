"""``bitune bench data``: training throughput of Bitune against LoRA on a training config's own data.

Optimizer steps of both, interleaved, on the batches ``bitune train`` would draw (its length-grouped order),
reported as real (non-padding) tokens per second, the time ratio next to the FLOP ratio of the same real lengths,
and the padding share of an epoch with and without grouping.
"""

from __future__ import annotations

import statistics

import torch
import transformers
from rich.console import Console

from ..config import BituneConfig
from ..data.collate import Collator, pad_id
from ..data.sampling import grouped_order, padding_share
from ..hub import load_model
from ..model import BituneModel
from ..train import load_settings
from ..train.recipe import load_data
from .helpers import device_dtype, shown
from .train import step


def bench_data(args) -> dict:
    """``bitune bench data``: measure (:func:`measure`), print (:func:`render`), return the record."""
    return shown(measure(args), render)


def measure(args) -> dict:
    """Optimizer steps of LoRA and Bitune on a training config's own data and batch size, interleaved.

    Batches come in the trainer's length-grouped order (the first ``steps + 1`` batches of epoch 0). Reports
    real (non-padding) prompt + answer tokens per second for each method, their time ratio next to the FLOP ratio
    of the same real lengths, sum(2 P + A) / sum(P + A), and the padding share of a whole epoch with and without
    grouping. With ``rounds`` > 1 the same steps are timed again (the models keep training) and the time ratio
    is the median of the rounds' ratios (each round's in ``round_time_ratios``); tokens/s pool all rounds.
    """
    if args.steps < 1 or args.rounds < 1:
        raise ValueError("bench data needs --steps >= 1 and --rounds >= 1")
    settings = load_settings(args.config, args.overrides)
    device, dtype = device_dtype(args.dtype)
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
                seconds, _ = step(model, opts[v], batch, device)
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
    return result


def render(result: dict) -> None:
    """Print a :func:`measure` record in one paragraph (the targets are stated in docs/benchmarks.md)."""
    pad, rate = result["padding_share"], result["tokens_per_s"]
    Console().print(
        f"{result['model']} on {result['dataset']}, batch {result['batch_size']}, {result['steps']} steps each, "
        f"{result['device']}, {result['threads']} threads: LoRA {rate['lora']:.0f} real tokens/s, Bitune "
        f"{rate['bitune']:.0f}; time ratio {result['time_ratio']:.2f}x (median of {result['rounds']} round(s)), "
        f"FLOP ratio of the real lengths {result['flop_ratio']:.2f}x, time / FLOP ratio "
        f"{result['time_over_flop_ratio']:.2f}. Padding share of an epoch (two prompt passes): grouped "
        f"{100 * pad['grouped']:.1f}%, random {100 * pad['random']:.1f}%.")
