"""Datasets, the paper's templates, and tokenization into the model's batch tensors."""

from .collate import Collator, tokenize_dataset, tokenize_example
from .datasets import DATASETS, DatasetInfo, load_examples, load_file
from .templates import Example

__all__ = [
    "DATASETS",
    "Collator",
    "DatasetInfo",
    "Example",
    "load_examples",
    "load_file",
    "tokenize_dataset",
    "tokenize_example",
]
