"""The model card (``README.md``) of a Bitune checkpoint, in the Hugging Face format.

Every checkpoint folder bitune writes (:meth:`BituneModel.save_pretrained`, ``bitune train``'s ``final/`` and
``checkpoint-N``, ``BituneSFTTrainer``'s saves) gets one: YAML metadata (``base_model``, ``library_name: bitune``,
``tags``, ``datasets``, ``pipeline_tag``, made by ``huggingface_hub``'s :class:`~huggingface_hub.ModelCardData`),
then what the checkpoint is, how to load, generate with, chat with and serve it, the training settings when it
comes from training, and the evaluation results when an ``eval.json`` of ``bitune eval`` sits beside it.

One job per module: :mod:`~bitune.modelcard.text` renders the card (pure functions),
:mod:`~bitune.modelcard.evaluation` finds and reads the ``eval.json`` it shows, :mod:`~bitune.modelcard.files`
writes the ``README.md`` (never over a user's own) and :mod:`~bitune.modelcard.hub` uploads a checkpoint with
its card. Everything public is importable from ``bitune.modelcard`` itself.

The card is written to be read on the Hugging Face Hub as well as on disk: it shows no absolute local path (a
local file or folder appears by its name, the checkpoint by its path relative to the working directory), links
to no file outside the folder, gives ``base_model`` as the upstream Hub id of a built-in model
(:data:`UPSTREAM`) and a ``license``. :func:`push_to_hub` uploads a checkpoint with its card rewritten for the
repository (download and load commands that name it) and the run's ``eval.json`` beside it.

A card bitune wrote carries :data:`MARKER` (and ``library_name: bitune``) and is rewritten on every save. A
``README.md`` without them is the user's own: it is never overwritten (a save that replaces the folder carries it
over byte for byte). The card is written to a temporary file and renamed into place, inside the folder a save
builds before renaming it into place.
"""

from .evaluation import GSM8K_METRIC, Evaluation, Score, find_evaluation
from .files import CARD_FILE, is_ours, read_training, refresh_evaluation, write, write_card
from .hub import push_to_hub
from .text import (
    EXPORT_MARKER,
    HUB_ID,
    MARKER,
    PAPER,
    UNKNOWN_LICENSE,
    UPSTREAM,
    Training,
    Upstream,
    evaluation_section,
    hub_base,
    render,
    render_export,
    shown_path,
    tags_for,
    training_of,
)

__all__ = ["CARD_FILE", "EXPORT_MARKER", "GSM8K_METRIC", "HUB_ID", "MARKER", "PAPER", "UNKNOWN_LICENSE", "UPSTREAM",
           "Evaluation", "Score", "Training", "Upstream", "evaluation_section", "find_evaluation", "hub_base", "is_ours",
           "push_to_hub", "read_training", "refresh_evaluation", "render", "render_export", "shown_path", "tags_for",
           "training_of", "write", "write_card"]
