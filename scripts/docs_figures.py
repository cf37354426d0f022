"""Make the documentation's figures (docs/figures/), from the code and a committed run, not by hand.

    python scripts/docs_figures.py            # all three; the attention map loads SmolLM2-135M (offline, ~1 min)

- ``passes.png``: a diagram of Bitune's passes and the cache they fill (matplotlib, drawn here).
- ``mixing_over_steps.png``, ``mixing_final.png``: ``bitune plot mixing`` on the committed log of the CSQA
  study's Bitune run, seed 42 (``results/smollm2-arc-csqa/csqa/bitune-42/log.jsonl``).
- ``attention.png``: ``bitune plot attention`` on SmolLM2-135M wrapped as Bitune and saved untrained (both
  adapters start as no-ops, so these are the pretrained weights reading one prompt causally and bidirectionally,
  what training starts from).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures"
LOG = ROOT / "results" / "smollm2-arc-csqa" / "csqa" / "bitune-42" / "log.jsonl"
PROMPT = "Where do you put a plate after washing it?"


def bitune(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "bitune"), *args], check=True)


def box(ax, x, y, w, h, text, color):
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="0.25"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)


def arrow(ax, x0, y0, x1, y1):
    ax.annotate("", xy=(x1, y1), xytext=(x0, y0), arrowprops=dict(arrowstyle="->", color="0.25", lw=1.2))


def draw_passes(path: Path) -> None:
    """Prompt → two prompt passes (own weights, own mask) → per-layer mixing → KV cache → causal answer pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.6))
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 3.6)
    ax.axis("off")
    box(ax, 0.1, 1.35, 1.6, 0.9, "prompt\n(all but its\nlast token)", "#eeeeee")
    box(ax, 2.3, 2.3, 2.4, 1.0, "causal pass\ncausal weights (LoRA c)\ncausal mask", "#cfe2f3")
    box(ax, 2.3, 0.3, 2.4, 1.0, "bidirectional pass\nbidir weights (LoRA b)\nfull mask over the prompt", "#f4cccc")
    box(ax, 5.3, 1.3, 1.9, 1.0, "mix per layer\nK = (1-a_k) K_c + a_k K_b\nV = (1-a_v) V_c + a_v V_b", "#fff2cc")
    box(ax, 7.6, 1.35, 1.0, 0.9, "KV cache\n(prompt)", "#d9ead3")
    box(ax, 7.3, 2.65, 2.6, 0.8, "answer pass, causal weights:\nlast prompt token + answer", "#cfe2f3")
    arrow(ax, 1.7, 1.95, 2.3, 2.75)
    arrow(ax, 1.7, 1.65, 2.3, 0.85)
    ax.text(4.85, 2.55, "K_c, V_c", fontsize=8)
    ax.text(4.85, 1.0, "K_b, V_b", fontsize=8)
    arrow(ax, 4.7, 2.8, 5.6, 2.3)
    arrow(ax, 4.7, 0.8, 5.6, 1.3)
    arrow(ax, 7.2, 1.8, 7.6, 1.8)
    arrow(ax, 8.1, 2.25, 8.1, 2.65)
    ax.text(5.3, 0.45, "a = |θ| / (θ_init + |θ|): 2 learnt numbers per layer (eq. 6-7)", fontsize=8)
    ax.text(7.3, 0.9, "decoding: one causal step per\ntoken, as any model (merged\nweights at inference)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    draw_passes(OUT / "passes.png")
    bitune("plot", "mixing", "--log", str(LOG), "--output", str(OUT))
    with tempfile.TemporaryDirectory() as tmp:  # an untrained Bitune wrap of the base model, as a checkpoint
        from bitune import BituneConfig, BituneModel
        from bitune.hub import load_model

        base, _ = load_model("smollm2-135m")
        BituneModel.wrap(base, BituneConfig(base_model="smollm2-135m")).save_pretrained(tmp)
        bitune("plot", "attention", "--checkpoint", tmp, "--prompt", PROMPT, "--template", "paper",
               "--output", str(OUT))
    print(f"wrote {sorted(p.name for p in OUT.glob('*.png'))} to {OUT}")


if __name__ == "__main__":
    from bitune.cli import run_script

    sys.exit(run_script("docs figures", main))
