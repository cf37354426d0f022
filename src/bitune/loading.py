"""What ``bitune generate``, ``chat``, ``plot``, ``serve`` and ``eval`` load: a Bitune checkpoint, or a base model
as the ``pretrained`` variant, with its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .checkpoint import read_config
from .config import PROMPT_PASSES, BituneConfig
from .errors import BituneError
from .files import check_named
from .hub import check_dtype, load_model, resolve_device
from .model import BituneModel

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_bitune(checkpoint: str | None = None, model: str | None = None, base: str | None = None,
                dtype: torch.dtype | str = "float32", device: str | None = None, prompt_passes: str = "auto",
                merge: bool | str = True) -> tuple[BituneModel, PreTrainedTokenizerBase]:
    """Load a Bitune checkpoint, or a base model as the ``pretrained`` variant, with its tokenizer.

    Give exactly one of ``checkpoint`` and ``model``.

    Args:
        checkpoint: a folder written by :meth:`BituneModel.save_pretrained`.
        model: a base model name or folder (instead of ``checkpoint``): a built-in name, a local folder or a hub
            id (:func:`bitune.hub.load_model`).
        base: with ``checkpoint``, the base model to load instead of the one the checkpoint records.
        dtype: parameter dtype, a ``torch.dtype`` or its name (``float32``, ``bfloat16``, ``float16``). Default
            float32.
        device: torch device (``cpu``, ``cuda``, ``cuda:1``, ``mps``); default cuda if available, else cpu.
        prompt_passes: how the passes run (``bitune.config.PROMPT_PASSES``; a runtime choice, not saved).
            Default ``"auto"``.
        merge: merge the causal weights into the base weights for inference (:meth:`BituneModel.merge`: the causal
            passes and decoding run the base model's own linear layers); ``"both"`` also holds the bidir weights
            merged, in a copy of the adapted weights (the bidir prompt pass at the base model's cost); ``False``
            keeps PEFT's unmerged adapter layers. Default True.

    Returns:
        model: The :class:`BituneModel` in eval mode on ``device``; a base model is the ``pretrained`` variant.
        tokenizer: Its tokenizer, padding on the left.

    Raises:
        BituneError: both or neither of ``checkpoint`` and ``model`` given; ``prompt_passes``, ``dtype`` or
            ``device`` not valid (or the device not on this machine); the checkpoint records no base model and
            ``base`` is not given; the base model cannot be loaded.
        ValueError: ``checkpoint`` is not a Bitune checkpoint, or its weights do not match the base model.
    """
    if (checkpoint is None) == (model is None):
        raise BituneError("give exactly one of a checkpoint folder or a base model name")
    for flag, value in (("--checkpoint", checkpoint), ("--base", base)):
        if value is not None:
            check_named(value, flag)  # "" is no folder to read, nor "use the recorded base model"
    if merge not in (True, False, "both"):
        raise BituneError(f"merge={merge!r} is not True, False or 'both'")
    if prompt_passes not in PROMPT_PASSES:
        raise BituneError(f"prompt_passes={prompt_passes!r} is not one of {', '.join(PROMPT_PASSES)}")
    device = resolve_device(device)
    check_dtype(dtype)
    if checkpoint is not None:
        name = base if base is not None else read_config(Path(checkpoint)).base_model  # --base "": an error
        if not name:
            raise BituneError(f"{checkpoint}: the checkpoint does not record its base model; name the base model")
        try:
            hf_model, tokenizer = load_model(name, dtype=dtype)
        except BituneError as e:
            if base is not None:
                raise
            raise BituneError(f"{e} (the base model recorded in checkpoint {checkpoint}; if it has moved, give it "
                              "with --base DIR)") from e
        bitune = BituneModel.from_pretrained(checkpoint, base=hf_model, prompt_passes=prompt_passes,
                                             merge=merge)
    else:
        hf_model, tokenizer = load_model(model, dtype=dtype)
        bitune = BituneModel(hf_model, BituneConfig(variant="pretrained", base_model=model), prompt_passes)
    return bitune.to(device).eval(), tokenizer


__all__ = ["load_bitune"]
