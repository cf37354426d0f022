"""The merged export: a Bitune model's decode half as a standard transformers model folder, with the checkpoint
the prompt passes need beside it (``bitune export``; see ``docs/guides/serving-at-scale.md``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from . import checkpoint
from .errors import BituneError
from .files import apply_umask, replace_dir, write_text_atomic
from .modelcard import CARD_FILE, Training, render_export


@torch.no_grad()
def export_merged(model, directory: str | os.PathLike, tokenizer=None, keep: tuple[str, ...] = (),
                  training: Training | None = None) -> Path:
    """Write the decode model of a GPU fleet: the causal weights merged into a standard transformers model folder
    (``config.json`` + ``model.safetensors``, no adapter layers: ``AutoModelForCausalLM.from_pretrained`` loads
    it, and its ``generate`` continues any Bitune prefill of this model with the same tokens), plus ``bitune/``,
    the model's checkpoint (:meth:`~bitune.model.BituneModel.save_pretrained`: the bidir set, the mixer and the
    config) for the prefill workers that compute the mixed cache, and a card (``README.md``) that says first what
    the folder is: loaded alone, the decoding half, not the trained model. Written to a temporary folder and renamed into
    place. An unmerged model is merged for the export and unmerged after it (its base weights then differ from
    before by float rounding: export a model you will train further from a fresh load).

    Args:
        model: the :class:`~bitune.model.BituneModel` to export.
        directory: the output folder (replaced if it exists; its parents are created).
        tokenizer: also saved into the folder, when given (default None).
        keep: names of entries in an existing ``directory`` that the export did not write (a user's README.md):
            kept through the replacement (:func:`bitune.files.replace_dir`). Default none.
        training: the run that trained the checkpoint (:func:`bitune.modelcard.read_training` of its folder): the
            card of ``bitune/`` keeps its training section. Default none.

    Returns:
        The folder, as a ``Path``.

    Raises:
        BituneError: the method is ``full`` (its causal set is a whole model already: ``bitune/causal``), or the
            merge is declined (it would change the model's logits: naming by how much).
    """
    if model.config.method == "full" and model.config.weight_sets:
        raise BituneError("method 'full' holds the causal weights as a whole model already (causal/ in its "
                          "checkpoint); there is nothing to merge")
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    was_merged = model.merged
    model.merge()
    try:
        if not model.merged:  # the merge checked itself and was undone (BituneModel.merge)
            reason = (model.support.note or "the merged weights do not give the model's logits").removeprefix(
                "merge() declined: ")
            raise BituneError(f"this model's causal weights cannot be merged: {reason}. There is no merged model "
                              "to export; serve or generate from the checkpoint itself")
        plain = model.weights.merged_model()
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        try:
            plain.config._name_or_path = ""  # not the folder it was loaded from: that is the base, not this
            plain.save_pretrained(tmp, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            if CARD_FILE not in keep:  # a user's own README.md is kept instead (said by the caller)
                write_text_atomic(tmp / CARD_FILE, render_export(model.config))
            checkpoint.save(model, tmp / "bitune", training=training,
                            destination=directory / "bitune")  # its card shows where
            apply_umask(tmp)
            replace_dir(tmp, directory, keep)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        if not was_merged:
            model.unmerge()
    return directory


__all__ = ["export_merged"]
