"""A tiny Bitune checkpoint on disk whose base model is a local folder, for the generate/chat/plot CLIs."""

from __future__ import annotations

from pathlib import Path

from bitune import BituneModel
from helpers.models import perturb_adapters, tiny_bitune, tiny_model
from helpers.tokenizer import tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
"""A chat template in the tiny tokenizer's alphabet; each turn ends with the eos token."""


def perturbed_bitune(base_dir: str | None = None, variant: str = "bitune", scale: float = 0.3) -> BituneModel:
    """A tiny Llama wrapped as ``variant``, adapters perturbed so that both weight sets matter."""
    model = tiny_bitune(variant=variant, base_model=base_dir)
    return perturb_adapters(model, scale=scale) if variant != "pretrained" else model


def save_checkpoint(root: Path, variant: str = "bitune", chat_template: bool = False) -> tuple[Path, BituneModel]:
    """Save a tiny base model + tokenizer to ``root/base`` and a checkpoint on it to ``root/ckpt``."""
    base_dir = root / "base"
    tokenizer = tiny_tokenizer()
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tiny_model().save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    model = perturbed_bitune(str(base_dir), variant)
    model.save_pretrained(root / "ckpt")
    return root / "ckpt", model
