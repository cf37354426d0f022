"""The training recipe: settings in, trained model out (load base model and data, wrap, train, save)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import transformers

from ..data import datasets
from ..data.collate import Collator, pad_id, tokenize_dataset
from ..errors import BituneError
from ..hub import load_model
from ..model import BituneModel
from ..provenance import source_commit, versions
from .run_folder import RunStart, start_run
from .settings import TrainSettings
from .trainer import TrainResult, build_trainer, run_training


def load_data(settings: TrainSettings, tokenizer, split: str, limit: int | None,
              say: Callable[[str], None] = print) -> tuple[list[dict], int]:
    """Tokenized samples of one split, with the number dropped for exceeding ``max_length``."""
    examples = datasets.load_examples(settings.dataset, split, limit=limit)
    if not examples:
        raise BituneError(f"dataset {settings.dataset!r} split {split!r} is empty")
    samples, dropped = tokenize_dataset(tokenizer, examples, settings.max_length)
    if not samples:
        raise BituneError(f"all {len(examples)} examples of {settings.dataset}/{split} are longer than "
                          f"max_length={settings.max_length} tokens; raise max_length")
    say(f"bitune train: {settings.dataset}/{split}: {len(samples)} examples, {dropped} dropped "
        f"(longer than max_length={settings.max_length})")
    return samples, dropped


def train(settings: TrainSettings, resume: bool = False, say: Callable[[str], None] = print,
          overwrite: bool = False) -> TrainResult:
    """Run a training job end to end.

    Loads the base model (``bitune.hub.load_model``) and the data, wraps the model as ``settings.bitune``
    says, trains with :class:`~bitune.train.trainer.BituneTrainer` (an explicit loop), and writes ``final/``,
    ``log.jsonl``, ``settings.yaml`` and checkpoints into ``settings.output_dir``.

    Args:
        settings: the validated run settings.
        resume: continue from the last complete checkpoint in ``output_dir``.
        say: where progress lines go.
        overwrite: allow replacing a run in ``output_dir`` (see :func:`bitune.train.run_folder.check_run_folder`).

    Raises:
        BituneError: unknown model or dataset, empty split, max_length beyond the model's positions, a run
            folder that would be overwritten or is in use, a corrupt checkpoint, a diverged run.
    """
    if settings.bitune.variant == "pretrained":
        raise BituneError("bitune.variant='pretrained' trains nothing; pick a trainable variant")
    main = int(os.environ.get("RANK", "0")) == 0
    with start_run(settings.output_dir, settings, resume, overwrite, main) as run:  # held to the end of the run
        return _train(settings, run, say if main else _silent)  # one process of a multi-process job reports


def _train(settings: TrainSettings, run: RunStart, say: Callable[[str], None]) -> TrainResult:
    base, tokenizer = load_model(settings.model)
    check_max_length(settings.max_length, base.config, settings.model)
    train_data, dropped = load_data(settings, tokenizer, settings.train_split, settings.limit, say)
    eval_data = None
    if settings.eval_split is not None:
        eval_data, _ = load_data(settings, tokenizer, settings.eval_split, settings.eval_limit, say)
    transformers.set_seed(settings.seed)  # adapter init depends on it
    config = dataclasses.replace(settings.bitune, base_model=settings.model,
                                 template=datasets.dataset_template(settings.dataset))  # generate/chat/eval reuse it
    say(f"bitune train: {config.template} template (the format of {settings.dataset}; recorded in the checkpoint)")
    model = BituneModel.wrap(base, config, prompt_passes=settings.prompt_passes)
    trainer = build_trainer(model, settings, train_data, eval_data, Collator(pad_id(tokenizer)), tokenizer=tokenizer)
    result = run_training(trainer, settings, run.resume, overwrite=run.overwrite, run=run, first_log={
        "event": "data", "commit": source_commit(), "versions": versions(), "dataset": settings.dataset,
        "train_examples": len(train_data), "dropped": dropped,
        "eval_examples": len(eval_data) if eval_data is not None else 0})
    loss = result.metrics.get("train_loss", result.metrics.get("train_loss_since_resume", float("nan")))
    say(f"bitune train: final model in {result.final_dir} (train_loss {loss:.4f})")
    return result


def check_max_length(max_length: int, model_config, name: str) -> None:
    """Refuse a ``max_length`` beyond the model's maximum position (samples that long would run past the
    positions it was trained on).

    Raises:
        BituneError: naming both lengths and the fix.
    """
    limit = getattr(getattr(model_config, "get_text_config", lambda: model_config)(), "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise BituneError(f"max_length={max_length} is longer than model {name!r}'s maximum position ({limit} "
                          f"tokens); set max_length <= {limit} (longer samples are dropped and counted)")


def _silent(line: str) -> None:
    pass


__all__ = ["train", "load_data"]
