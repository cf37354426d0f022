"""The paper's figures of a run and a checkpoint (drawn by ``bitune plot``).

* ``mixing`` (paper A.5, figures 2-3): the mixing ratios a_k and a_v (eq. 8) of every layer over the training
  steps, read from a run's ``log.jsonl`` and starting at step 0 from the initial a = 0.5, and their final value
  per layer.
* ``attention`` (paper A.12): the attention of the causal and the bidirectional prompt pass over one prompt,
  averaged over layers and heads, side by side.

matplotlib (optional) is imported only where a figure is drawn, and only its object-oriented API is used (no pyplot,
no global backend).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .adapters import WeightSets
from .attention import attention_implementation
from .config import RECORDED_DEFAULTS, BituneConfig, init_share_problem
from .errors import BituneError
from .files import check_input_file, jsonl_records
from .generation import encode, render
from .inputs import check_prompt
from .masks import pass_mask, position_ids

STEPS_FILE = "mixing_over_steps.png"
FINAL_FILE = "mixing_final.png"
ATTENTION_FILE = "attention.png"
PASS_TITLES = {"causal/causal": "causal pass (causal weights, causal mask)",
               "bidir/bidirectional": "bidirectional pass (bidir weights, no mask)",
               "causal/bidirectional": "bidirectional pass (causal weights, no mask)",
               "bidir/causal": "second causal pass (bidir weights)",
               "bidir/anti_causal": "anti-causal pass (bidir weights)"}


# --------------------------------------------------------------------------------------------------- mixing
def read_mixing_log(path: str | Path) -> tuple[list[int], dict[str, list[list[float]]]]:
    """Steps and per-layer mixing ratios of a training log.

    Args:
        path: a run's ``log.jsonl`` (lines with ``step`` and ``a_k`` / ``a_v`` lists, one value per layer).

    Returns:
        ``(steps, {"k": [[a per layer] per step], "v": ...})``, in step order, starting at step 0 with the initial
        ratio of every layer (training logs start at step ``log_every``): the run's ``bitune.init_share`` from the
        ``settings.yaml`` beside the log, else 0.5; where a step is logged twice (the end-of-training summary
        repeats the last step), its last line counts.
    """
    path = check_input_file(path, "--log", expected="log.jsonl")  # a run folder: its log.jsonl is named
    by_step: dict[int, tuple[list[float], list[float]]] = {}
    for n, record in jsonl_records(path, "--log"):
        if not isinstance(record, dict) or ("a_k" not in record and "a_v" not in record):
            continue  # not a mixing record (the log also holds other lines)
        step, ratios = record.get("step"), [_ratios(record.get(key), f"{path}:{n}: {key}") for key in ("a_k", "a_v")]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise BituneError(f"{path}:{n}: 'step' is {step!r}; a training step is an integer >= 0")
        L = len(next(iter(by_step.values()))[0]) if by_step else len(ratios[0])
        if not len(ratios[0]) == len(ratios[1]) == L:
            raise BituneError(f"{path}:{n}: a_k/a_v have a different number of layers than earlier lines")
        by_step[step] = (ratios[0], ratios[1])
    if not by_step:
        raise BituneError(f"{path} holds no mixing ratios (a_k/a_v): is it the log of a variant that mixes?")
    L = len(next(iter(by_step.values()))[0])
    start = initial_ratio(path)
    by_step.setdefault(0, ([start] * L, [start] * L))
    steps = sorted(by_step)
    return steps, {"k": [by_step[s][0] for s in steps], "v": [by_step[s][1] for s in steps]}


def initial_ratio(log: Path) -> float:
    """Every layer's a at step 0 of the run that wrote ``log``: its ``bitune.init_share`` (``settings.yaml`` beside
    the log), or the paper's 0.5 when the run records none (a run made before the share was recorded started
    there: :data:`bitune.config.RECORDED_DEFAULTS`)."""
    import yaml

    settings = log.parent / "settings.yaml"
    try:
        data = yaml.safe_load(settings.read_text(encoding="utf-8")) if settings.is_file() else None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise BituneError(f"{settings}: not readable YAML ({e}); it records the run's initial mixing ratio") from e
    share = ((data or {}).get("bitune") or {}).get("init_share") if isinstance(data, dict) else None
    if share is None:
        return RECORDED_DEFAULTS["init_share"]
    theta_init = data["bitune"].get("theta_init")  # the share is checked against the run's own scale
    if isinstance(theta_init, bool) or not isinstance(theta_init, (int, float)) or not theta_init > 0:
        theta_init = BituneConfig.theta_init
    problem = init_share_problem(share, theta_init)
    if problem:
        raise BituneError(f"{settings}: bitune.{problem}")
    return float(share)


def _ratios(values, where: str) -> list[float]:
    """One line's mixing ratios: a non-empty list of numbers in [0, 1] (a = |θ| / (θ_init + |θ|)), one per layer."""
    if not isinstance(values, list) or not values:
        raise BituneError(f"{where} is {values!r}; expected a list of mixing ratios, one per layer")
    for i, a in enumerate(values):
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise BituneError(f"{where}[{i}] is {a!r}; a mixing ratio is a number in [0, 1]")
    return [float(a) for a in values]


def mixing_figures(steps: list[int], ratios: dict[str, list[list[float]]]):
    """Figure 2 (a per layer over steps, panels K and V) and figure 3 (final a per layer) as matplotlib Figures."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    L = len(ratios["k"][0])
    cmap, norm = colormaps["viridis"], Normalize(0, max(L - 1, 1))
    curves = Figure(figsize=(11, 4.2), layout="constrained")
    axes = curves.subplots(1, 2, sharey=True)
    marker = "o" if len(steps) <= 20 else None  # a few logged steps: show each as a point, not only a line
    for ax, key in zip(axes, ("k", "v")):
        for layer in range(L):
            ax.plot(steps, [r[layer] for r in ratios[key]], color=cmap(norm(layer)), linewidth=1.2, marker=marker,
                    markersize=3)
        ax.set_title(f"$a_{key}$ ({key.upper()} features) per layer")
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("bidirectional-to-causal ratio a")
    curves.colorbar(ScalarMappable(norm, cmap), ax=axes, label="layer index")
    logged = [s for s in steps if s > 0]
    note = f": only step {logged[0]} was logged (log_every is longer than the run)" if len(logged) == 1 else ""
    curves.suptitle(f"Mixing ratios over training (paper fig. 2){note}")

    final = Figure(figsize=(6.5, 4), layout="constrained")
    ax = final.subplots()
    layers = list(range(L))
    for key, marker in (("k", "o"), ("v", "s")):
        ax.plot(layers, ratios[key][-1], marker=marker, label=f"$a_{key}$")
    ax.axhline(ratios["k"][0][0], color="grey", linestyle=":", linewidth=1,
               label=f"initial value {ratios['k'][0][0]:g}")
    ax.set_xlabel("layer index")
    ax.set_ylabel("bidirectional-to-causal ratio a")
    ax.set_title(f"Mixing ratios after training, step {steps[-1]} (paper fig. 3)")
    ax.legend()
    ax.grid(alpha=0.3)
    return curves, final


def plot_mixing(log: str | Path, output_dir: str | Path) -> list[Path]:
    """Write :data:`STEPS_FILE` and :data:`FINAL_FILE` for a run's ``log.jsonl`` into ``output_dir``.

    Warns on stderr when the log holds one training step only: its curves are then a straight line from step 0.
    """
    steps, ratios = read_mixing_log(log)
    if len(steps) <= 2:
        print(f"bitune plot: warning: {log} holds mixing ratios of one training step only (step {steps[-1]}; "
              f"log_every is longer than the run?): each curve joins the initial a = {ratios['k'][0][0]:g} at step 0 "
              "to it",
              file=sys.stderr)
    curves, final = mixing_figures(steps, ratios)
    return [_save(curves, output_dir, STEPS_FILE), _save(final, output_dir, FINAL_FILE)]


# --------------------------------------------------------------------------------------------------- attention
def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """One short printable label per token id (spaces shown as ``␣``, newlines as ``\\n``)."""
    return [tokenizer.decode([i]).replace(" ", "␣").replace("\n", "\\n") or str(i) for i in ids]


@torch.no_grad()
def attention_maps(weights: WeightSets, passes: tuple[tuple[str, str], ...], text_config, prompt_ids: torch.Tensor,
                   prompt_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Attention of each prompt pass, averaged over layers and heads (paper A.12).

    Each pass runs once more with eager attention (the only implementation that returns attention weights).

    Args:
        weights: the weight sets (``BituneModel.weights``).
        passes: ``(weight set, mask kind)`` per prompt pass (``BituneConfig.passes``).
        text_config: the model's text config.
        prompt_ids, prompt_mask: (B, P) left-padded prompts, at least 2 real tokens each.

    Returns:
        ``{"<weights>/<mask>": (B, T, T)}`` per pass over the prompt without its last token; row = query.
    """
    check_prompt(prompt_ids, prompt_mask)
    ids, mask = prompt_ids[:, :-1], prompt_mask[:, :-1]  # (B, T)
    base = weights.base
    dtype = next(base.parameters()).dtype
    maps = {}
    with attention_implementation(base, "eager"):
        for name, kind in passes:
            attn = pass_mask(mask, kind, dtype, text_config, "eager")
            out = weights.call(name, input_ids=ids, attention_mask=attn, output_attentions=True,
                                     position_ids=position_ids(mask), logits_to_keep=1)
            maps[f"{name}/{kind}"] = torch.stack(out.attentions).float().mean(dim=(0, 2))  # (B, T, T)
    return maps


def attention_figure(maps: dict[str, torch.Tensor], labels: list[str] | None = None, max_labels: int = 40):
    """Side-by-side heatmaps of (T, T) attention maps (row = query token, column = key token).

    Args:
        maps: ``{"<weights>/<mask>": (T, T)}`` as :func:`attention_maps` returns them (one row).
        labels: the T token labels, drawn on both axes when T <= ``max_labels``.
    """
    from matplotlib.figure import Figure

    T = next(iter(maps.values())).shape[-1]
    show = labels is not None and T <= max_labels
    side = 4.2 + (0.12 * T if show else 0)
    fig = Figure(figsize=(side * len(maps) + 1, side), layout="constrained")
    axes = fig.subplots(1, len(maps), squeeze=False)[0]
    vmax = max(float(m.max()) for m in maps.values())
    for ax, (name, attn) in zip(axes, maps.items()):
        image = ax.imshow(attn.float().cpu().numpy(), cmap="Blues", vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.set_title(PASS_TITLES.get(name, name))
        ax.set_xlabel("key token (attended to)")
        ax.set_ylabel("query token")
        if show:
            ax.set_xticks(range(T), labels, rotation=90, fontsize=7)
            ax.set_yticks(range(T), labels, fontsize=7)
    fig.colorbar(image, ax=axes, label="attention (mean over layers and heads)", shrink=0.8)
    fig.suptitle("Prompt attention, averaged over layers and heads\n(paper A.12)")
    return fig


def plot_attention(model, tokenizer, prompt: str, output_dir: str | Path, template: str = "paper",
                   max_labels: int = 40) -> Path:
    """Write :data:`ATTENTION_FILE`: the attention maps of each prompt pass of ``model`` over ``prompt``.

    The passes read the prompt without its last token (which opens the answer), so that token is not shown.
    """
    text, special = render(tokenizer, prompt, template)
    ids, mask = encode(tokenizer, [text], special, next(model.parameters()).device)  # (1, P)
    maps = attention_maps(model.weights, model.config.passes, model.text_config, ids, mask)
    maps = {name: m[0] for name, m in maps.items()}  # (T, T) each, T = P - 1
    fig = attention_figure(maps, token_labels(tokenizer, ids[0, :-1].tolist()), max_labels)
    return _save(fig, output_dir, ATTENTION_FILE)


def _save(fig, output_dir: str | Path, name: str) -> Path:
    path = Path(output_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    return path
