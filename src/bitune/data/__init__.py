"""Datasets, the paper's templates, and tokenization into the model's batch tensors.

The tokenization helpers (which need torch) are imported on first use, so reading and checking data does not.
"""

from .conversations import ChatExample
from .datasets import DATASETS, DatasetInfo, dataset_template, load_examples, load_file
from .templates import Example

__all__ = [
    "DATASETS",
    "ChatExample",
    "Collator",
    "DatasetInfo",
    "Example",
    "dataset_template",
    "load_examples",
    "load_file",
    "tokenize_dataset",
    "tokenize_example",
]
_FROM_COLLATE = ("Collator", "tokenize_dataset", "tokenize_example")


def __getattr__(name: str):
    if name in _FROM_COLLATE:
        from . import collate

        return getattr(collate, name)
    raise AttributeError(f"module 'bitune.data' has no attribute {name!r}")
