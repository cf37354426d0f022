"""Bitune: bidirectional instruction-tuning of decoder-only LLMs (Kopiczko, Blankevoort, Asano).

The model classes are imported on first use (module ``__getattr__``), so ``import bitune`` and the CLI's help
and settings validation do not load torch, transformers or PEFT.
"""

from .config import METHODS, VARIANTS, BituneConfig

__all__ = ["BituneConfig", "BituneModel", "BituneOutput", "Prefill", "VARIANTS", "METHODS"]
__version__ = "0.1.0"
_FROM_MODEL = ("BituneModel", "BituneOutput", "Prefill")


def __getattr__(name: str):
    if name in _FROM_MODEL:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module 'bitune' has no attribute {name!r}")
