"""What the benchmarks share: device and dtype, the models compared, random batches, timing, the bytes autograd
saves for backward, the order of interleaved rounds, list options and the JSON record."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from ..config import BituneConfig
from ..files import write_text_atomic
from ..hub import load_model
from ..model import BituneModel


def device_dtype(name: str) -> tuple[torch.device, torch.dtype]:
    """The benchmark's device (CUDA when there is one, else the CPU) and the dtype ``--dtype name`` asks for
    (``auto``: bfloat16 on CUDA, float32 on CPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, name)


def build(model_name: str, variant: str, device: torch.device, dtype: torch.dtype, **config):
    """A fresh Bitune model of ``variant`` (adapters as initialised: the same compute as trained ones) on
    ``model_name``, in training mode, and its tokenizer."""
    base, tokenizer = load_model(model_name, dtype=dtype)
    model = BituneModel.wrap(base.to(device), BituneConfig(variant=variant, **config))
    return model.train(), tokenizer


def random_batch(vocab: int, B: int, P: int, A: int, device: torch.device | str = "cpu", seed: int = 0):
    """Random prompt and answer tokens, all real (masks of ones), the same for the same arguments.

    Returns:
        ``(prompt_ids, prompt_mask, answer_ids, answer_mask)``, shapes (B, P), (B, P), (B, A), (B, A): the
        positional arguments of a Bitune model's forward.
    """
    g = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 2)  # skip the special tokens at the start of most vocabularies
    prompt = torch.randint(low, vocab, (B, P), generator=g).to(device)  # (B, P)
    answer = torch.randint(low, vocab, (B, A), generator=g).to(device)  # (B, A)
    return prompt, torch.ones_like(prompt), answer, torch.ones_like(answer)


def random_prompts(vocab: int, B: int, P: int, device: torch.device | str = "cpu", seed: int = 0):
    """The prompt half of :func:`random_batch`: ``(ids, mask)``, each (B, P)."""
    return random_batch(vocab, B, P, 1, device, seed)[:2]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a clock read after it counts the work."""
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes, the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved(items: Sequence, round_index: int) -> list:
    """The order to run ``items`` in on round ``round_index``: as given on even rounds, reversed on odd ones, so
    that no item keeps a fixed position and a trend in the machine's speed hits all alike."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


class SavedBytes:
    """Bytes of the distinct storages autograd saves for the backward while it is installed (see
    :func:`count_saved`), each storage counted once. Parameters and other trained leaf tensors are never counted.

    ``activations`` leaves out views of them too (the ``weight.t()`` a linear layer saves, FSDP's gathered
    parameters): what the forward creates, what activation checkpointing cuts. ``total`` counts those views'
    storages as well, the weights a backward keeps alive.
    """

    def __init__(self):
        self._activations: dict[int, int] = {}
        self._parameter_views: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if _trained_or_parameter(t):
            return t
        s = t.untyped_storage()
        of_parameter = t._base is not None and _trained_or_parameter(t._base)
        (self._parameter_views if of_parameter else self._activations)[s.data_ptr()] = s.nbytes()
        return t

    @property
    def activations(self) -> int:
        return sum(self._activations.values())

    @property
    def total(self) -> int:
        return self.activations + sum(self._parameter_views.values())


def _trained_or_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf)


@contextlib.contextmanager
def count_saved() -> Iterator[SavedBytes]:
    """Count what autograd saves for the backward inside the ``with`` block::

        with count_saved() as saved:
            loss = model(*batch).loss
        saved.activations
    """
    counter = SavedBytes()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        yield counter


def int_list(text: str, option: str, low: int) -> list[int]:
    """The comma-separated integers of option ``option``, each at least ``low`` (a clear error otherwise)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} {text!r}: comma-separated integers") from None
    if not values or min(values) < low:
        raise ValueError(f"{option} {text!r}: every value must be >= {low}")
    return values


def write_json(result: dict, path: str | Path) -> None:
    """Write a benchmark's record as indented JSON (atomically: a reader never sees half a file)."""
    write_text_atomic(Path(path), json.dumps(result, indent=2))


def shown(record: dict, render) -> dict:
    """Print a benchmark's ``record`` with its ``render`` function and return it (a ``bitune bench`` verb:
    measure, then render, then hand the numbers on)."""
    render(record)
    return record


def check_checkpoint(option: str, given: str, model: str, lora: bool = False) -> None:
    """A benchmark's checkpoint, read before anything loads: a row is named after what it serves or scores, and
    compares models of one base. ``option`` is what gave it (``--bitune``, ``--checkpoint``).

    Args:
        lora: the row is LoRA's (a ``lora`` checkpoint); else a Bitune variant's (two prompt passes).

    Raises:
        BituneError: the checkpoint is of another kind, or was trained on another base model than ``model``.
    """
    from ..checkpoint import read_config
    from ..errors import BituneError

    config = read_config(given)
    if (config.variant == "lora") != lora or config.variant == "pretrained":
        raise BituneError(f"{option} {given} is a {config.variant!r} checkpoint; {option} needs "
                          f"{'a lora' if lora else 'a Bitune-variant'} checkpoint")
    if config.base_model not in (None, model) and not _same_folder(config.base_model, model):
        raise BituneError(f"{option} {given} was trained on {config.base_model!r}, not --model {model!r}: the rows "
                          "would compare different models")


def _same_folder(a: str, b: str) -> bool:
    """Whether two model names are one local folder (a relative and an absolute path to it)."""
    return Path(a).expanduser().is_dir() and Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
