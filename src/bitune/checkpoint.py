"""The checkpoint format of a :class:`~bitune.model.BituneModel`: write one, read its config, load its weights into a
model. (Building a model from a checkpoint is :meth:`BituneModel.from_pretrained`; "a checkpoint or a base model,
with its tokenizer" is :func:`bitune.loading.load_bitune`; this module does not import :mod:`bitune.model`, which
imports it.)

A checkpoint folder holds ``bitune_config.json`` (:class:`~bitune.config.BituneConfig`: what was trained, never how
the passes run), ``mixer.safetensors`` (the thetas, for mixing variants) and one folder per weight set: PEFT's own
adapter format (``adapter_config.json`` + ``adapter_model.safetensors``, loadable by plain PEFT) or, for full
fine-tuning, a transformers model folder (``causal/``) and the bidir copy (``bidir/model.safetensors``), plus the
model card ``README.md`` (:mod:`bitune.modelcard`; a user's own README is kept) and, where one is saved with it,
the tokenizer's files. No pickles. It is written into a temporary folder and renamed into place, so an existing
checkpoint is never left half-overwritten; or, into a folder that holds other things (a TRL ``output_dir``), moved
in file by file with the config removed first and written last, so a half-written one is never taken for complete.
Loading is strict (every tensor must match).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import torch
from peft.utils import set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from .config import CONFIG_FILE, read_config
from .files import apply_umask, replace_dir
from .hub import load_model, recorded_base
from .modelcard import CARD_FILE, Training, is_ours
from .modelcard import write as write_card

MIXER_FILE = "mixer.safetensors"
WEIGHT_SETS = ("causal", "bidir")
"""Folder names of the weight sets a checkpoint can hold."""
FULL_FILE = "model.safetensors"


def save(model, directory: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None,
         training: Training | None = None, destination: str | os.PathLike | None = None,
         replaces: bool = True, tokenizer=None) -> None:
    """Save adapters (PEFT format, one folder per weight set), mixer (safetensors), config (JSON) and model card.

    Args:
        model: the :class:`~bitune.model.BituneModel` (its config, weight sets and mixer).
        tensors: the weights to write, named as :meth:`BituneModel.weight_tensors` names them (e.g. gathered from
            a sharded model); default: the model's own.
        training: the run that saved it, for the model card.
        destination: where the checkpoint will end up when ``directory`` is a staging folder the caller moves
            (default: ``directory``): the card shows that path, reads the ``eval.json`` beside it and keeps a
            user's ``README.md`` there.
        replaces: the folder at ``destination`` is replaced whole by this one (its other files go with it).
            False: the checkpoint's files are moved into ``directory`` one by one and its other entries are kept
            (``checkpoint-N`` folders, logs, an ``eval.json``, a user's ``README.md``); parts of an earlier
            checkpoint there that this one lacks are removed, and its config is removed first and written last,
            so a folder interrupted while being written is not taken for a complete checkpoint.
        tokenizer: saved with the checkpoint (its ``save_pretrained`` files), if given.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = {k: p.detach() for k, p in model.weight_tensors().items()}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        part, name = key.split(":", 1)
        parts.setdefault(part, {})[name] = t.detach().cpu().contiguous()
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    config, weights = model.config, model.weights
    config = dataclasses.replace(config, base_model=recorded_base(config.base_model))  # found from any folder
    try:
        (tmp / CONFIG_FILE).write_text(config.to_json())
        if model.mixer is not None:
            save_file(parts["mixer"], str(tmp / MIXER_FILE))
        if weights.peft:
            state = {k: t for name in config.weight_sets for k, t in parts[name].items()}
            weights.model.save_pretrained(str(tmp), selected_adapters=list(config.weight_sets), state_dict=state)
            (tmp / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template: ours follows
        elif config.method == "full" and config.weight_sets:
            buffers = {k: v for k, v in weights.model.state_dict(keep_vars=True).items()
                       if not isinstance(v, nn.Parameter)}
            weights.model.save_pretrained(str(tmp / "causal"), state_dict={**buffers, **parts["causal"]},
                                          max_shard_size="1000GB")
            if "bidir" in config.weight_sets:
                (tmp / "bidir").mkdir()
                save_file({k.replace(".", "__"): t for k, t in parts["bidir"].items()}, str(tmp / "bidir" / FULL_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        write_card(tmp, config, training, directory if destination is None else destination, replaces)
        apply_umask(tmp)  # mkdtemp made it 0700 and safetensors writes 0600: others may read a checkpoint
        if replaces:
            replace_dir(tmp, directory)
        else:
            _move_into(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into(staged: Path, directory: Path) -> None:
    """Move the checkpoint written in ``staged`` into ``directory``, keeping the folder's other entries: its config
    removed first and written last, parts of an earlier checkpoint that this one lacks removed, a user's own
    ``README.md`` (copied into ``staged`` by the card writer) left as it is."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).unlink(missing_ok=True)  # from here until the end, not a complete checkpoint
    for name in (*WEIGHT_SETS, MIXER_FILE):
        stale = directory / name
        if (staged / name).exists():
            continue
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale)
        else:
            stale.unlink(missing_ok=True)
    for entry in sorted(staged.iterdir(), key=lambda p: p.name == CONFIG_FILE):  # the config last
        if entry.name == CARD_FILE and not is_ours(entry):
            continue
        if entry.is_dir():
            replace_dir(entry, directory / entry.name)
        else:
            os.replace(entry, directory / entry.name)


def load_weights(model, directory: str | os.PathLike) -> None:
    """Load trained weights from a checkpoint folder into ``model``, strictly (every tensor must match)."""
    directory = Path(directory)
    config = model.config
    stray = [n + "/" for n in WEIGHT_SETS if n not in config.weight_sets and (directory / n).exists()]
    if model.mixer is None and (directory / MIXER_FILE).exists():
        stray.insert(0, MIXER_FILE)
    if stray:  # weights the config does not use: it was edited, or the folder mixes two checkpoints
        raise ValueError(f"{directory} holds {', '.join(stray)}, which its config (variant {config.variant!r}) does "
                         "not use: the config and the weights disagree")
    if model.mixer is not None:
        state = _read_safetensors(directory / MIXER_FILE)
        try:
            model.mixer.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{directory / MIXER_FILE} does not match this model: {e}") from e
    weights = model.weights
    for name in model.config.weight_sets:
        params = weights.parameters_of(name)
        if weights.peft:
            path = directory / name / "adapter_model.safetensors"
            state = _read_safetensors(path)
            try:
                result = set_peft_model_state_dict(weights.model, state, adapter_name=name)
            except RuntimeError as e:
                raise ValueError(f"{path} does not match this model/config: {str(e).splitlines()[-1]}") from e
            if result.unexpected_keys:
                raise ValueError(f"{path}: unexpected tensors {result.unexpected_keys[:3]}: "
                                 "the checkpoint does not match this model/config")
            if len(state) != len(params):
                raise ValueError(f"{path}: holds {len(state)} tensors, this model expects {len(params)}: "
                                 "the checkpoint does not match this model/config")
        elif name == "causal":
            path = directory / "causal" / FULL_FILE
            state = _read_safetensors(path)
            missing, unexpected = weights.model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if k in params]:
                raise ValueError(f"{path}: does not match this model (missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]})")
        else:
            path = directory / "bidir" / FULL_FILE
            _copy_exactly({k.replace(".", "__"): p for k, p in params.items()}, _read_safetensors(path), path)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one checkpoint file, every value finite (NaN/inf: a diverged or damaged run)."""
    if not path.is_file():
        raise ValueError(f"checkpoint file missing: {path}")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"corrupt checkpoint file {path}: {e}") from e
    for k, t in state.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor {k} holds NaN or infinite values (a diverged or damaged checkpoint)")
    return state


def _copy_exactly(params: dict[str, nn.Parameter], state: dict, path: Path) -> None:
    if set(state) != set(params):
        raise ValueError(f"{path} does not match this model: different tensor names")
    with torch.no_grad():
        for k, p in params.items():
            if state[k].shape != p.shape:
                raise ValueError(f"{path}: tensor {k} has shape {tuple(state[k].shape)}, expected {tuple(p.shape)}")
            p.copy_(state[k])



def base_model(directory, config, base=None, **load_kwargs):
    """The base model a checkpoint is loaded onto: ``base`` when it is a model instance, else the one it names or,
    by default, the ``base_model`` the checkpoint's config records (:func:`bitune.hub.load_model` with
    ``load_kwargs``).

    Raises:
        ValueError: the checkpoint records no base model and ``base`` is not given.
    """
    if base is not None and not isinstance(base, str):
        return base
    name = base or config.base_model
    if not name:
        raise ValueError(f"{directory}: the checkpoint does not record its base model; pass base=")
    return load_model(name, **load_kwargs)[0]


__all__ = ["base_model", "CONFIG_FILE", "MIXER_FILE", "save", "load_weights", "read_config"]
