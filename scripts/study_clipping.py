"""Gradient clipping and the mixer's share of the gradient in a study task's runs, from their committed logs.

    .venv/bin/python scripts/study_clipping.py results/qwen2.5-arc-easy-csqa/arc_easy

For every finished run ``<folder>/<method>-<seed>`` (a ``log.jsonl`` with a ``train_runtime`` record), per method and
learning rate: the logged steps where clipping fired, i.e. where the norm that the run's ``clip`` setting clips
(``all``: the global norm ``grad_norm``; ``adapters``: ``grad_norm_adapters``) exceeds its ``max_grad_norm``; the
factor the adapters' gradients were scaled by (``max_grad_norm`` over that norm, at most 1; median and lowest over
logged steps); the median norm of each group before clipping (adapters, mixer); for runs that mix, the mixer's share
of the squared global norm (``grad_norm_mixer`` squared over ``grad_norm`` squared; range over runs of each run's
median and its lowest), the lowest bidirectional share of any single layer (``a_k`` or ``a_v``) at any logged step,
and the largest change of one layer's share between two consecutive logged steps (``log_every`` steps apart). Only
logged steps are seen (one in ``log_every``); the logs record norms before clipping.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from bitune.cli import run_script
from bitune.errors import BituneError
from bitune.files import jsonl_records, read_text
from bitune.plot import read_mixing_log


def run_facts(run: Path) -> dict[str, float] | None:
    """One run's clipping and mixing facts, or None when its training has not finished."""
    log = run / "log.jsonl"
    records = [r for _, r in jsonl_records(log, "log.jsonl") if isinstance(r, dict)]
    if not any("train_runtime" in r for r in records):
        return None
    settings = yaml.safe_load(read_text(run / "settings.yaml", "settings.yaml"))
    steps = {r["step"]: r for r in records if "grad_norm" in r and "loss" in r}  # the summary repeats a step
    limit = settings["max_grad_norm"]
    clipped_norm = "grad_norm_adapters" if settings.get("clip", "all") == "adapters" else "grad_norm"
    norms = [r.get(clipped_norm, r["grad_norm"]) for r in steps.values()]  # a LoRA log: one group, grad_norm
    factors = [min(1.0, limit / n) if limit and n > 0 else 1.0 for n in norms]
    adapters = [r.get("grad_norm_adapters", r["grad_norm"]) for r in steps.values()]
    facts = {"logged": len(steps), "clipped": sum(n > limit for n in norms) if limit else 0,
             "factor_median": statistics.median(factors), "factor_min": min(factors),
             "adapters_norm": statistics.median(adapters)}
    if any("grad_norm_mixer" in r for r in steps.values()):
        facts["mixer_norm"] = statistics.median(r["grad_norm_mixer"] for r in steps.values() if "grad_norm_mixer" in r)
    shares = [r["grad_norm_mixer"] ** 2 / r["grad_norm"] ** 2 for r in steps.values() if "grad_norm_mixer" in r]
    if shares:
        _, ratios = read_mixing_log(log)
        layers = [step_k + step_v for step_k, step_v in zip(ratios["k"], ratios["v"])]  # per logged step
        facts |= {"mixer_median": statistics.median(shares), "mixer_min": min(shares),
                  "layer_min": min(min(step) for step in layers),
                  "layer_move": max(abs(a - b) for prev, step in zip(layers, layers[1:]) for a, b in zip(prev, step))}
    return facts


def main(folder: Path) -> int:
    """Print one line per method, learning rate and clip setting of ``folder``'s finished runs."""
    if not folder.is_dir():
        raise BituneError(f"{folder}: not a folder")
    groups: dict[tuple[str, float, str], list[dict[str, float]]] = defaultdict(list)
    for run in sorted(p.parent for p in folder.glob("*-*/log.jsonl")):
        facts = run_facts(run)
        if facts is None:
            print(f"{run.name}: has not finished training, left out")
            continue
        settings = yaml.safe_load(read_text(run / "settings.yaml", "settings.yaml"))
        groups[(run.name.rsplit("-", 1)[0], settings["lr"], settings.get("clip", "all"))].append(facts)
    if not groups:
        raise BituneError(f"{folder}: no finished run (<method>-<seed>/log.jsonl with a train_runtime record)")
    for (method, lr, clip), runs in groups.items():
        clipped = ", ".join(f"{r['clipped']}/{r['logged']}" for r in runs)
        line = (f"{method} (lr {lr:g}, clip {clip}, {len(runs)} runs): clipped at {clipped} logged steps; the "
                f"adapters' gradient scaled by median {_span(runs, 'factor_median')}, lowest {_span(runs, 'factor_min')}"
                f"; median norm before clipping: adapters {_span(runs, 'adapters_norm')}")
        if "mixer_norm" in runs[0]:
            line += f", mixer {_span(runs, 'mixer_norm')}"
        if "mixer_median" in runs[0]:
            line += (f"; mixer's share of the squared norm: median {_span(runs, 'mixer_median')}, lowest "
                     f"{_span(runs, 'mixer_min')}; a layer's lowest share {_span(runs, 'layer_min')}; a layer's "
                     f"largest move between logged steps {_span(runs, 'layer_move')}")
        print(line)
    return 0


def _span(runs: list[dict[str, float]], key: str) -> str:
    """The range of one fact over runs, two decimals."""
    low, high = min(r[key] for r in runs), max(r[key] for r in runs)
    return f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}-{high:.2f}"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(run_script("study clipping", lambda: main(Path(sys.argv[1]))))
