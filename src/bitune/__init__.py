"""Bitune: bidirectional instruction-tuning of decoder-only LLMs (Kopiczko, Blankevoort, Asano)."""

from .config import METHODS, VARIANTS, BituneConfig
from .model import BituneModel, BituneOutput, Prefill

__all__ = ["BituneConfig", "BituneModel", "BituneOutput", "Prefill", "VARIANTS", "METHODS"]
__version__ = "0.1.0"
