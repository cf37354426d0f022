"""``BituneSFTTrainer``: train a :class:`~bitune.model.BituneModel` inside TRL's ``SFTTrainer``.

What changes against a plain ``SFTTrainer``, and why:

- rows are tokenized by :mod:`bitune.trl.rows` (the tokens of ``bitune train``), handed to TRL pre-tokenized
  (``input_ids`` + ``labels`` with -100 on the prompt);
- TRL swaps the model's ``forward`` for a fused LM head over one concatenated sequence; the swap is undone and
  :meth:`compute_loss` splits each right-padded batch into left-padded prompts and right-padded answers
  (:func:`~bitune.trl.rows.split_batch`) and calls ``BituneModel.forward``, the forward ``bitune train`` runs, so
  the loss is the example mean (:class:`bitune.model.BituneOutput`);
- the optimizer holds exactly ``model.trainable_parameters()``, the mixer's thetas without weight decay;
- the example order comes from :mod:`bitune.data.sampling` (uniformly shuffled, or length-grouped by prompt and
  answer length with ``train_sampling_strategy="group_by_length"``), seeded by ``args.seed`` and the epoch only:
  the order of ``bitune train`` with the same seed and grouping;
- ``save_model`` and every ``checkpoint-N`` hold a Bitune checkpoint (:mod:`bitune.checkpoint`, with the
  tokenizer), which ``bitune generate / eval / chat`` and ``BituneModel.from_pretrained`` load; resuming reads
  it back. The model card (``README.md``, TRL's ``create_model_card``) is Bitune's (:mod:`bitune.modelcard`).

Refused, each with one error saying why: packing and padding-free batches (a Bitune forward needs each prompt
and answer apart), gradient checkpointing (it drops the prompt passes' KV cache the answer reads), options that
replace the loss, and rows Bitune cannot use (see :mod:`bitune.trl.rows`).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

import datasets
import torch
import trl
from torch import nn
from transformers import Trainer
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from ..checkpoint import CONFIG_FILE, MIXER_FILE, load_weights, save
from ..config import BituneConfig
from ..data.sampling import LengthGroupedSampler, ShuffledSampler
from ..errors import BituneError
from ..files import replace_dir
from ..model import BituneModel
from ..modelcard import CARD_FILE, Training, is_ours
from ..modelcard import write as write_card
from ..processes import world_size
from .rows import split_batch, tokenize_rows

logger = logging.get_logger(__name__)
CARD_SETTINGS = ("max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "weight_decay", "max_grad_norm",
                 "optim", "seed", "data_seed", "max_length", "train_sampling_strategy", "bf16",
                 "activation_checkpointing")
"""The ``SFTConfig`` fields a checkpoint's model card records."""

class TrainerModel(nn.Module):
    """The face a ``BituneModel`` shows to ``Trainer``: the base model's transformers config, generation config
    and model tags, and a forward taking the four batch tensors (so DDP wraps exactly the Bitune forward)."""

    def __init__(self, bitune: BituneModel):
        super().__init__()
        self.bitune = bitune

    @property
    def config(self):
        return self.bitune.weights.base.config

    @property
    def generation_config(self):
        return self.bitune.weights.base.generation_config

    def add_model_tags(self, tags: list[str]) -> None:
        self.bitune.weights.base.add_model_tags(tags)

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """What ``Trainer`` calls for ``activation_checkpointing=True`` (SFTConfig's default): Bitune's own
        checkpointing (:meth:`BituneModel.enable_checkpointing`: every decoder layer, the prompt caches kept),
        not transformers' (which drops the prompt cache). Its options were checked by the trainer."""
        self.bitune.enable_checkpointing()

    gradient_checkpointing_enable = activation_checkpointing_enable  # the deprecated name transformers may call

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.bitune.checkpointing

    def forward(self, prompt_ids, prompt_mask, answer_ids, answer_mask):
        return self.bitune(prompt_ids, prompt_mask, answer_ids, answer_mask)


class BituneSFTTrainer(SFTTrainer):
    """TRL's ``SFTTrainer`` for a Bitune model (what changes against a plain one: :mod:`bitune.trl.trainer`).

    The checkpoint records ``base_model`` (the name given, else the base model's ``name_or_path``) and the
    template of the data (``chat`` for conversations, ``none`` for verbatim prompts), so ``bitune generate``
    writes prompts the way training read them. A merged model (loaded for inference) is unmerged to train.

    Args:
        model: a :class:`BituneModel`, or the name/folder of a base model (``bitune.hub.load_model``: built-in
            names such as ``smollm2-135m`` load offline), wrapped with ``bitune_config``.
        args: an ``SFTConfig`` (required); its default ``activation_checkpointing=True`` runs Bitune's own
            checkpointing (every decoder layer, the prompt caches kept: the same loss and gradients). On a
            machine without GPUs also ``bf16=False`` (bf16 is slow on CPUs) and ``use_cpu=True`` (needed by
            transformers to run several processes as one group).
        train_dataset: a ``datasets.Dataset`` (required) of prompt-completion, conversational or conversational
            prompt-completion rows (:mod:`bitune.trl.rows`); rows longer than ``args.max_length`` tokens are
            dropped and counted (:attr:`dropped`).
        eval_dataset: rows of the same kinds, for evaluation (optional): a ``datasets.Dataset`` or a dict of them.
        processing_class: the tokenizer; required with a :class:`BituneModel`, default: the one loaded with a
            named model.
        bitune_config: how to wrap a named model (default: Bitune + LoRA r8); only with a name.
        **kwargs: the rest of ``SFTTrainer``'s arguments (``callbacks``, ``optimizers``, ...).

    Raises:
        BituneError: ``args`` is missing or not an ``SFTConfig``, or sets an option Bitune refuses (packing,
            padding-free batches, selective or offloaded activation checkpointing, ``use_reentrant``,
            ``assistant_only_loss``, ``completion_only_loss=False``, another ``loss_type`` or label smoothing);
            an argument Bitune refuses is given (``peft_config``, ``formatting_func``, ``compute_loss_func``,
            ``compute_metrics``, ``data_collator``); ``model`` is neither a :class:`BituneModel` nor a name, or
            is a :class:`BituneModel` given with ``bitune_config`` or without ``processing_class``; the variant
            is ``pretrained``; a dataset is missing, not a ``datasets.Dataset``, empty, longer than
            ``max_length`` in every row, or has rows Bitune cannot use; the config's template does not fit the
            data; FSDP or DeepSpeed is on; the launch has several processes but ``args`` sets up one.
    """

    _tag_names = ["trl", "sft", "bitune"]
    loss_is_scaled_for_ga = False
    """Read by ``Trainer``: :meth:`compute_loss` returns the batch's example mean and ``Trainer`` divides it by
    the accumulation steps, as ``bitune train`` does."""

    def __init__(self, model: BituneModel | str, args: SFTConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, bitune_config: BituneConfig | None = None, **kwargs):
        if args is None:
            raise BituneError("BituneSFTTrainer needs args=SFTConfig(output_dir=..., ...)")
        _check_options(args, kwargs)
        model, processing_class = _bitune_model(model, bitune_config, processing_class)
        if model.config.variant == "pretrained":
            raise BituneError("BituneSFTTrainer: variant='pretrained' trains nothing; pick a trainable variant")
        model.unmerge()  # a model loaded for inference (merged) trains on its unmerged factors
        if args.activation_checkpointing:  # Bitune's own (Trainer calls it again in train(): idempotent)
            model.enable_checkpointing()
        if train_dataset is None:
            raise BituneError("BituneSFTTrainer needs a train_dataset")
        max_length = args.max_length
        train, dropped, template = _prepare(train_dataset, processing_class, max_length, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: _prepare(v, processing_class, max_length, f"eval[{k!r}]")[0]
                            for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = _prepare(eval_dataset, processing_class, max_length, "eval")[0]
        model.config = _record(model.config, template, model.weights.base)
        if args.ddp_find_unused_parameters is None:
            args.ddp_find_unused_parameters = False  # every trainable parameter gets a gradient, as in bitune train
        self.dropped = dropped
        """Training rows dropped for being longer than ``args.max_length`` tokens."""
        super().__init__(model=TrainerModel(model), args=args, train_dataset=train, eval_dataset=eval_dataset,
                         processing_class=processing_class, **kwargs)
        vars(self.model).pop("forward", None)  # undo TRL's fused-LM-head forward: Bitune's forward is the loss
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise BituneError("BituneSFTTrainer: FSDP and DeepSpeed are refused (the trainer saves and loads whole, "
                              "unsharded Bitune weights); run data-parallel (DDP: configs/accelerate/ddp.yaml)")

    @property
    def bitune_model(self) -> BituneModel:
        """The model being trained."""
        return self.model.bitune

    # ----------------------------------------------------------------------------------------------- steps
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Example-mean loss of the batch through ``BituneModel.forward`` (:class:`bitune.model.BituneOutput`).

        Args:
            model: the model ``Trainer`` runs (the Bitune model, possibly wrapped by DDP).
            inputs: TRL's batch: (B, T) right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on the
                prompt), split into left-padded prompts and right-padded answers
                (:func:`bitune.trl.rows.split_batch`).
            return_outputs: also return the forward's output.
            num_items_in_batch: unused: every example weighs the same, as in ``bitune train``.

        Returns:
            The loss (a scalar tensor); with ``return_outputs``, the pair ``(loss, output)``.

        Raises:
            BituneError: a row's labels are not a prompt of at least 2 tokens followed by an answer, or the
                training loss is not finite (training diverged).
        """
        batch = split_batch(inputs["input_ids"], inputs["attention_mask"], inputs["labels"],
                            self.processing_class.pad_token_id)
        out = model(*batch)
        if self.model.training and not torch.isfinite(out.loss.detach()):
            raise BituneError(f"training diverged at step {self.state.global_step + 1}: the loss is "
                              f"{float(out.loss.detach())}; lower the learning rate or set max_grad_norm")
        return (out.loss, out) if return_outputs else out.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The evaluation loss only (``eval_loss``: the mean of the batches' example means).

        Args:
            model: the model ``Trainer`` runs.
            inputs: TRL's batch, as in :meth:`compute_loss`.
            prediction_loss_only: unused: only the loss is returned.
            ignore_keys: unused.

        Returns:
            ``(loss, None, None)``: no logits or labels are returned.
        """
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def create_optimizer(self, model=None):
        """``args.optim`` (default AdamW) over exactly the Bitune model's trainable parameters; the mixer's thetas
        without weight decay, as in ``bitune train``.

        Args:
            model: unused (the Bitune model is the one trained).

        Returns:
            The optimizer, created once (an optimizer passed as ``optimizers=`` is kept).
        """
        if self.optimizer is None:
            bitune = self.bitune_model
            params = list(bitune.trainable_parameters().values())
            mixer = {id(p) for p in bitune.mixer.parameters()} if bitune.mixer is not None else set()
            groups = [{"params": [p for p in params if id(p) not in mixer], "weight_decay": self.args.weight_decay},
                      {"params": [p for p in params if id(p) in mixer], "weight_decay": 0.0}]
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        return self.optimizer

    def _get_train_sampler(self, train_dataset=None):
        """Bitune's seed-and-epoch-determined order (:mod:`bitune.data.sampling`), length-grouped per global
        batch (``per_device_train_batch_size`` x processes) with ``train_sampling_strategy="group_by_length"``;
        seeded by ``args.data_seed``, else ``args.seed``."""
        data = train_dataset if train_dataset is not None else self.train_dataset
        strategy = self.args.train_sampling_strategy
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        if strategy == "group_by_length":
            lengths = [(labels.count(-100), len(labels) - labels.count(-100)) for labels in data["labels"]]
            group = self.args.per_device_train_batch_size * self.accelerator.num_processes
            return LengthGroupedSampler(lengths, group, seed=seed)
        if strategy != "random":
            raise BituneError(f"train_sampling_strategy={strategy!r}: BituneSFTTrainer draws 'random' or "
                              "'group_by_length' orders")
        return ShuffledSampler(len(data), seed)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Write a Bitune checkpoint (adapters, mixer, config) and the tokenizer into ``output_dir``.

        Other entries of the folder (``checkpoint-N``, logs) are kept, parts of an earlier checkpoint this one
        lacks are removed; the config is removed first and written last, so a folder interrupted while being
        written is not taken for a complete checkpoint."""
        if not self.args.should_save:
            return
        out = Path(output_dir if output_dir is not None else self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            save(self.bitune_model, tmp / "checkpoint", training=self.training_record(), destination=out,
                 replaces=False)
            self.processing_class.save_pretrained(str(tmp / "checkpoint"))
            (out / CONFIG_FILE).unlink(missing_ok=True)
            for name in ("causal", "bidir", MIXER_FILE):  # parts of an earlier checkpoint this one lacks
                stale = out / name
                if (tmp / "checkpoint" / name).exists():
                    continue
                if stale.is_dir():
                    shutil.rmtree(stale)
                else:
                    stale.unlink(missing_ok=True)
            entries = sorted((tmp / "checkpoint").iterdir(), key=lambda p: p.name == CONFIG_FILE)
            for entry in entries:
                if entry.name == CARD_FILE and not is_ours(entry):
                    continue  # the user's own README.md in out: kept as it is
                if entry.is_dir():
                    replace_dir(entry, out / entry.name)
                else:
                    os.replace(entry, out / entry.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | list[str] | None = None,
                          tags: str | list[str] | None = None) -> None:
        """Write Bitune's model card (:mod:`bitune.modelcard`) as ``output_dir/README.md`` in place of TRL's, whose
        usage text (a transformers pipeline) does not load a Bitune checkpoint. TRL calls it before every
        ``checkpoint-N`` and ``push_to_hub`` after saving; a user's own README there is kept.

        Args:
            model_name: unused (the card names the variant and base model).
            dataset_name: the training data's name(s), for the card's ``datasets`` metadata.
            tags: extra metadata tags, after ``trl``, ``sft`` and ``bitune``.
        """
        if not self.is_world_process_zero():
            return
        names = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
        extra = [tags] if isinstance(tags, str) else list(tags or [])
        write_card(self.args.output_dir, self.bitune_model.config, self.training_record(names, extra))

    def training_record(self, dataset_names: list[str] | tuple[str, ...] = (),
                        tags: list[str] | tuple[str, ...] = ()) -> Training:
        """What the model card of a checkpoint saved now records: the ``SFTConfig`` values that shape training, the
        processes, the rows dropped, the step and epoch.

        Args:
            dataset_names: the training data's names, for the card's ``datasets`` metadata.
            tags: extra metadata tags, after ``trl``, ``sft`` and ``bitune``.

        Returns:
            The record (:class:`bitune.modelcard.Training`).
        """
        args = self.args.to_dict()  # enums as their values
        settings = {k: args[k] for k in CARD_SETTINGS if k in args}
        settings.update(processes=self.args.world_size, rows_dropped=self.dropped)
        return Training(settings, f"BituneSFTTrainer (TRL {trl.__version__})", tuple(dataset_names),
                        (*self._tag_names, *tags), step=self.state.global_step, epoch=self.state.epoch)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_weights(self.bitune_model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        load_weights(self.bitune_model, self.state.best_model_checkpoint)


# --------------------------------------------------------------------------------------------------- helpers
def _check_options(args: SFTConfig, kwargs: dict) -> None:
    """Refuse what Bitune cannot train with, each with the reason."""
    if not isinstance(args, SFTConfig):
        raise BituneError(f"BituneSFTTrainer: args must be an SFTConfig, got {type(args).__name__}")
    if args.packing:
        raise BituneError("BituneSFTTrainer: packing=True is refused: Bitune reads each prompt on its own (twice) "
                          "and answers it, so examples cannot be packed into one sequence; set packing=False")
    if args.padding_free:
        raise BituneError("BituneSFTTrainer: padding_free=True is refused: Bitune's forward takes left-padded "
                          "prompts and right-padded answers apart, not one flattened sequence; set padding_free=False")
    if args.activation_checkpointing:  # SFTConfig's default: mapped onto Bitune's own checkpointing
        options = dict(args.activation_checkpointing_kwargs or {})
        if options.pop("selective", False):
            raise BituneError("BituneSFTTrainer: activation_checkpointing_kwargs={'selective': True} is refused: "
                              "Bitune checkpoints whole decoder layers (its prompt caches kept); drop 'selective'")
        if options.pop("every_n_layers", 1) != 1 or options.pop("offload", False):
            raise BituneError("BituneSFTTrainer: activation_checkpointing_kwargs every_n_layers and offload are "
                              "refused: Bitune checkpoints every decoder layer and keeps activations in place")
        if options.pop("use_reentrant", False):
            raise BituneError("BituneSFTTrainer: use_reentrant=True is refused: Bitune's checkpointing is "
                              "non-reentrant (it keeps the prompt caches); leave use_reentrant unset")
        if options:
            raise BituneError(f"BituneSFTTrainer: activation_checkpointing_kwargs {sorted(options)} are not "
                              "supported by Bitune's checkpointing")
    launched = world_size()
    if launched > 1 and args.world_size == 1:
        raise BituneError(f"BituneSFTTrainer: launched as {launched} processes, but this SFTConfig sets up 1 (on a "
                          "machine without GPUs, transformers runs them as one group only with use_cpu=True): every "
                          "process would train alone on all the data; pass SFTConfig(use_cpu=True)")
    if args.assistant_only_loss:
        raise BituneError("BituneSFTTrainer: assistant_only_loss=True is refused: Bitune learns the last assistant "
                          "turn of each conversation, the turns before it are the prompt; leave it False")
    if args.completion_only_loss is False:
        raise BituneError("BituneSFTTrainer: completion_only_loss=False is refused: Bitune's loss is on the answer "
                          "only (the prompt is read by the prompt passes); leave it None")
    if args.loss_type != "nll" or args.label_smoothing_factor:
        raise BituneError("BituneSFTTrainer: loss_type and label_smoothing_factor are refused: the loss is Bitune's "
                          "(each example's mean answer-token cross-entropy); leave loss_type='nll' and no smoothing")
    for name in ("peft_config", "formatting_func", "compute_loss_func", "compute_metrics", "data_collator"):
        if kwargs.get(name) is not None:
            raise BituneError(f"BituneSFTTrainer: {name}= is refused: "
                              + {"peft_config": "the BituneModel holds its own adapters (set them in BituneConfig)",
                                 "formatting_func": "it turns rows into plain text, with no prompt/answer split",
                                 "compute_loss_func": "the loss is Bitune's example mean",
                                 "compute_metrics": "evaluation reports eval_loss only (answer logits are not "
                                                    "aligned with TRL's sequences)",
                                 "data_collator": "batches are TRL's own right-padded prompt + answer rows, split "
                                                  "by the trainer"}[name])


def _bitune_model(model, bitune_config: BituneConfig | None, tokenizer):
    """The BituneModel and tokenizer to train: the model given, or a named base model loaded and wrapped."""
    if isinstance(model, BituneModel):
        if bitune_config is not None:
            raise BituneError("BituneSFTTrainer: bitune_config= is only for a model given by name; this "
                              "BituneModel already has its config")
        if tokenizer is None:
            raise BituneError("BituneSFTTrainer: pass processing_class=<tokenizer> with a BituneModel")
        return model, tokenizer
    if not isinstance(model, str):
        raise BituneError(f"BituneSFTTrainer: model must be a BituneModel or a base model name/folder, got "
                          f"{type(model).__name__} (wrap it with BituneModel.wrap)")
    from ..hub import load_model

    base, loaded = load_model(model)
    config = bitune_config if bitune_config is not None else BituneConfig()
    if config.base_model is None:
        config = dataclasses.replace(config, base_model=model)
    return BituneModel.wrap(base, config), tokenizer if tokenizer is not None else loaded


def _prepare(dataset, tokenizer, max_length: int | None, name: str):
    """Rows -> a pre-tokenized ``datasets.Dataset`` (``input_ids``, ``labels``), the dropped count, the template."""
    if not isinstance(dataset, datasets.Dataset):
        raise BituneError(f"BituneSFTTrainer: the {name} dataset must be a datasets.Dataset (streaming datasets "
                          f"are not supported), got {type(dataset).__name__}")
    samples, dropped, template = tokenize_rows(dataset, tokenizer, max_length, name)
    if dropped:
        logger.warning(f"BituneSFTTrainer: {name} dataset: {dropped} of {len(samples) + dropped} rows dropped "
                       f"(longer than max_length={max_length} tokens)")
    return datasets.Dataset.from_list(samples), dropped, template


def _record(config: BituneConfig, template: str, base: nn.Module) -> BituneConfig:
    """The config to save: the data's template and the base model's name recorded where they are unset.

    Raises:
        BituneError: the config records the chat template for verbatim prompts, or another template for
            conversations (generation would then write prompts unlike those trained on).
    """
    if config.template is not None and (config.template == "chat") != (template == "chat"):
        kind = "conversations" if template == "chat" else "prompt-completion text rows"
        raise BituneError(f"BituneConfig.template={config.template!r} does not fit {kind}: use "
                          f"{'chat' if template == 'chat' else 'none or paper'} (or leave it None)")
    name = config.base_model or getattr(base.config, "name_or_path", None) or None
    return dataclasses.replace(config, template=config.template or template, base_model=name)


__all__ = ["BituneSFTTrainer", "TrainerModel"]
