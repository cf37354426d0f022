"""``BituneSFTTrainer``: train a :class:`~bitune.model.BituneModel` inside TRL's ``SFTTrainer``.

What changes against a plain ``SFTTrainer``, and why:

- rows are tokenized by :mod:`bitune.trl.rows` (the tokens of ``bitune train``) into separate ``prompt_ids`` and
  ``answer_ids`` columns, and TRL's own dataset preparation is skipped (``dataset_kwargs={"skip_prepare_dataset":
  True}`` is set on ``args``), as TRL's DPO trainer keeps prompts and completions apart;
- the data collator is ``bitune train``'s :class:`~bitune.data.collate.Collator` (left-padded prompts,
  right-padded answers), and :meth:`compute_loss` calls ``BituneModel.forward`` on its four tensors, the forward
  ``bitune train`` runs, so the loss is the example mean (:class:`bitune.outputs.BituneOutput`). TRL's fused-LM-head
  forward, which it installs on the model, is left in place: without ``fused_lm_head=True``, which only TRL's own
  ``compute_loss`` passes, it calls the model's forward unchanged;
- the optimizer's parameter groups, the example order and the finite-loss check are ``bitune train``'s
  (:mod:`bitune.train.parts`): exactly ``model.trainable_parameters()``, the mixer's thetas without weight decay;
  uniformly shuffled, or length-grouped by prompt and answer length with
  ``train_sampling_strategy="group_by_length"``, seeded by ``args.seed`` and the epoch only;
- ``save_model`` and every ``checkpoint-N`` hold a Bitune checkpoint (:func:`bitune.checkpoint.save`, with the
  tokenizer), which ``bitune generate / eval / chat`` and ``BituneModel.from_pretrained`` load; resuming reads
  it back. The model card (``README.md``, TRL's ``create_model_card``) is Bitune's (:mod:`bitune.modelcard`).

Refused, each with one error saying why: packing and padding-free batches (a Bitune forward needs each prompt
and answer apart), activation checkpointing options Bitune's own checkpointing lacks (selective, offloaded,
reentrant), options that replace the loss or the collator, and rows Bitune cannot use (see
:mod:`bitune.trl.rows`).
"""

from __future__ import annotations

import dataclasses

import datasets
import torch
import trl
from torch import nn
from transformers import Trainer
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer

from ..checkpoint import load_weights, save
from ..config import BituneConfig
from ..data.collate import Collator, pad_id
from ..errors import BituneError
from ..model import BituneModel
from ..modelcard import Training
from ..modelcard import write as write_card
from ..processes import world_size
from ..train import parts
from .rows import COLUMNS, tokenize_rows

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
        checkpointing (:meth:`BituneModel.enable_recompute`: every decoder layer, the prompt caches kept),
        not transformers' (which drops the prompt cache). Its options were checked by the trainer."""
        self.bitune.enable_recompute()

    gradient_checkpointing_enable = activation_checkpointing_enable  # the deprecated name transformers may call

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.bitune.recomputing

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
            model.enable_recompute()
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
        args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}  # tokenized above
        self.dropped = dropped
        """Training rows dropped for being longer than ``args.max_length`` tokens."""
        super().__init__(model=TrainerModel(model), args=args, data_collator=Collator(pad_id(processing_class)),
                         train_dataset=train, eval_dataset=eval_dataset, processing_class=processing_class, **kwargs)
        if self.is_fsdp_enabled or self.is_deepspeed_enabled:
            raise BituneError("BituneSFTTrainer: FSDP and DeepSpeed are refused (the trainer saves and loads whole, "
                              "unsharded Bitune weights); run data-parallel (DDP: configs/accelerate/ddp.yaml)")

    @property
    def bitune_model(self) -> BituneModel:
        """The model being trained."""
        return self.model.bitune

    # ----------------------------------------------------------------------------------------------- steps
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Example-mean loss of the batch through ``BituneModel.forward`` (:class:`bitune.outputs.BituneOutput`).

        Args:
            model: the model ``Trainer`` runs (the Bitune model, possibly wrapped by DDP).
            inputs: the collator's batch: ``prompt_ids`` and ``prompt_mask`` (B, P) left-padded, ``answer_ids`` and
                ``answer_mask`` (B, A) right-padded (:class:`bitune.data.collate.Collator`).
            return_outputs: also return the forward's output.
            num_items_in_batch: unused: every example weighs the same, as in ``bitune train``.

        Returns:
            The loss (a scalar tensor); with ``return_outputs``, the pair ``(loss, output)``.

        Raises:
            BituneError: the training loss is not finite (training diverged).
        """
        out = model(inputs["prompt_ids"], inputs["prompt_mask"], inputs["answer_ids"], inputs["answer_mask"])
        if self.model.training:
            parts.check_loss(out.loss, self.state.global_step + 1, _advice)
        return (out.loss, out) if return_outputs else out.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The evaluation loss only (``eval_loss``: the mean of the batches' example means).

        Args:
            model: the model ``Trainer`` runs.
            inputs: the collator's batch, as in :meth:`compute_loss`.
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
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            self.optimizer = cls(parts.parameter_groups(self.bitune_model, self.args.weight_decay), **kwargs)
        return self.optimizer

    def _get_train_sampler(self, train_dataset=None):
        """``bitune train``'s seed-and-epoch-determined order (:func:`bitune.train.parts.sampler`), length-grouped
        by the prompt and answer columns per global batch (``per_device_train_batch_size`` x processes) with
        ``train_sampling_strategy="group_by_length"``; seeded by ``args.data_seed``, else ``args.seed``."""
        data = train_dataset if train_dataset is not None else self.train_dataset
        strategy = self.args.train_sampling_strategy
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        if strategy not in ("random", "group_by_length"):
            raise BituneError(f"train_sampling_strategy={strategy!r}: BituneSFTTrainer draws 'random' or "
                              "'group_by_length' orders")
        group = self.args.per_device_train_batch_size * self.accelerator.num_processes
        return parts.sampler(data, seed, group if strategy == "group_by_length" else None)

    def _get_eval_sampler(self, eval_dataset):
        """``Trainer``'s evaluation order (sequential), or with ``train_sampling_strategy="group_by_length"``
        ``bitune train``'s length-grouped one over the prompt and answer columns (less padding; ``eval_loss``, the
        mean over the examples, does not depend on the order)."""
        if self.args.train_sampling_strategy != "group_by_length":
            return super()._get_eval_sampler(eval_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return parts.sampler(eval_dataset, seed, self.args.per_device_eval_batch_size * self.accelerator.num_processes)

    def _set_signature_columns_if_needed(self):
        """The columns the collator reads: the ones ``remove_unused_columns`` keeps."""
        if self._signature_columns is None:
            self._signature_columns = list(COLUMNS)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """TRL's ``evaluate``; rows passed here are tokenized as the eval rows given to the trainer are (TRL's own
        dataset preparation is skipped).

        Args:
            eval_dataset: rows (a ``datasets.Dataset``, or a dict of them, each evaluated as ``Trainer`` does),
                the name of an eval dataset given to the trainer, or None (those given to the trainer).
            ignore_keys: passed on to ``Trainer.evaluate``.
            metric_key_prefix: the metrics' prefix.

        Raises:
            BituneError: rows Bitune cannot use (see :mod:`bitune.trl.rows`).
        """
        tokenizer, max_length = self.processing_class, self.args.max_length
        if isinstance(eval_dataset, dict):  # as Trainer.evaluate runs a dict: one evaluation per dataset
            metrics = {}
            for k, rows in eval_dataset.items():
                data = _prepare(rows, tokenizer, max_length, f"eval[{k!r}]")[0]
                metrics.update(super().evaluate(data, ignore_keys, f"{metric_key_prefix}_{k}"))
            return metrics
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = _prepare(eval_dataset, tokenizer, max_length, "eval")[0]
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ----------------------------------------------------------------------------------------------- checkpoints
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Write a Bitune checkpoint (adapters, mixer, config, model card) and the tokenizer into ``output_dir``
        (:func:`bitune.checkpoint.save` with ``replaces=False``): other entries of the folder (``checkpoint-N``,
        logs, a user's README) are kept, parts of an earlier checkpoint this one lacks are removed, and the config
        is removed first and written last, so a folder interrupted while being written is not taken for a complete
        checkpoint."""
        if not self.args.should_save:
            return
        save(self.bitune_model, output_dir if output_dir is not None else self.args.output_dir,
             training=self.training_record(), replaces=False, tokenizer=self.processing_class)

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
                                 "data_collator": "batches are bitune train's left-padded prompts and right-padded "
                                                  "answers (bitune.data.collate.Collator)"}[name])


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


def _advice() -> str:
    """What to change after a diverged step (the end of :func:`bitune.train.parts.check_loss`'s message)."""
    return "lower the learning rate or set max_grad_norm"


def _prepare(dataset, tokenizer, max_length: int | None, name: str):
    """Rows -> a tokenized ``datasets.Dataset`` (``prompt_ids``, ``answer_ids``), the dropped count, the template."""
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
