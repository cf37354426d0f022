"""The training loop: a small explicit loop (torchtune style) over a :class:`~bitune.model.BituneModel`.

Built from public pieces: accelerate's ``Accelerator`` (DDP over gloo on CPU / nccl on GPUs, bf16 autocast,
sharded data loaders), a ``DataLoader`` over :mod:`bitune.data.sampling`'s seed-determined orders, AdamW over
exactly ``model.trainable_parameters()`` (no decay on the mixing thetas) and transformers' linear warmup/decay
(the parameter groups, the order and the loss check shared with TRL's trainer: :mod:`.parts`).
A step accumulates ``grad_accum`` micro-batches, clips as ``clip`` says (:mod:`.gradients`), steps, then logs
(:mod:`.logger`), evaluates (:mod:`.evaluation`) and writes an atomic checkpoint (:mod:`.checkpoints`) when due.
``--resume`` restores weights, optimizer, scheduler and RNG and skips the batches already consumed in the current
epoch, so a resumed run ends bit-exact on the weights of an uninterrupted one (CPU).

The loss is the example mean of each batch (:class:`bitune.outputs.BituneOutput`'s ``loss``).
With ``N`` processes (``torchrun`` / ``accelerate launch`` / ``bitune train --num-processes N``) the model runs
in ``DistributedDataParallel``, each process takes its own ``batch_size`` examples of a global batch drawn in the
order of one process with batch ``N x batch_size``, and DDP averages the gradients, so N processes x batch b
give the update of one process with batch N x b (exactly, since every process holds b examples; only a short
last batch of an epoch weighs its examples differently). Logging, checkpoints and ``final/`` are written by the
main process only.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch.utils.data import DataLoader, Sampler
from tqdm.auto import tqdm

from ..data.sampling import RepeatedPrefix
from ..errors import BituneError
from ..model import BituneModel
from ..modelcard import Training
from ..processes import check_fsdp_processes
from . import parts, sharding
from .checkpoints import (
    kept_after_divergence,
    load_checkpoint,
    load_rng_state,
    non_finite,
    save_checkpoint,
    verify_checkpoint,
)
from .evaluation import eval_loss
from .gradients import clip_gradients
from .logger import JsonlLogger, Window, batch_digest
from .run_folder import (
    FINAL_DIR,
    LOG_FILE,
    RunStart,
    append_jsonl,
    check_world_size,
    checkpoint_step,
    start_run,
    truncate_log,
)
from .settings import TrainSettings


class StepHook(Protocol):
    """What :meth:`BituneTrainer.add_step_hook` takes: called after every optimizer step, before logging and
    saving, with the number of optimizer steps taken so far and the model (unwrapped); it may raise to stop the
    run (what the run keeps then is what an interrupted run keeps)."""

    def __call__(self, step: int, model: BituneModel) -> None: ...


@dataclass
class TrainState:
    """Where training stands; saved in every checkpoint's ``trainer_state.json``."""

    global_step: int = 0
    """Optimizer steps taken."""
    epoch: float = 0.0
    """Epochs done, fractional (micro-batches of the current epoch / micro-batches per epoch)."""
    loss_sum: float = 0.0
    """Sum of the per-step training losses (mean over processes) of all steps: ``train_loss`` is its mean."""


class BituneTrainer:
    """Trains a :class:`BituneModel` on tokenized examples batched by a :class:`bitune.data.collate.Collator`.

    Args:
        model: the wrapped model; its ``trainable_parameters()`` are exactly what is optimised.
        settings: the run's settings (batch, accumulation, schedule, clipping, checkpoints, logging).
        train_data: tokenized examples (``prompt_ids``, ``answer_ids`` lists).
        eval_data: tokenized validation examples, or None.
        collator: turns a list of examples into ``prompt_ids, prompt_mask, answer_ids, answer_mask``.
        tensorboard: also log to ``output_dir/tensorboard``.

    Hooks added with :meth:`add_step_hook` (:class:`StepHook`) run after every optimizer step, before logging and
    saving.
    """

    def __init__(self, model: BituneModel, settings: TrainSettings, train_data: list[dict],
                 eval_data: list[dict] | None, collator, tensorboard: bool = True, tokenizer=None):
        if model.config.variant == "pretrained":
            raise BituneError("bitune.variant='pretrained' trains nothing; pick a trainable variant")
        bf16, use_cpu = resolve_bf16(settings.bf16)
        model.unmerge()  # a model loaded for inference (merged) trains on its unmerged factors
        transformers.set_seed(settings.seed)
        fsdp = sharding.fsdp_options(settings.fsdp)
        self.fsdp, self._reshard = fsdp.shard, fsdp.reshard_after_forward
        self.bf16 = bf16
        self.accelerator = Accelerator(cpu=use_cpu, mixed_precision="bf16" if bf16 and not self.fsdp else "no",
                                       kwargs_handlers=[ddp_kwargs()])
        if self.fsdp:
            check_fsdp_processes(self.accelerator.num_processes)
        if settings.recompute or fsdp.checkpointing:
            model.enable_recompute()
        self.model = model
        self.settings = settings
        self.tokenizer = tokenizer  # saved with final/, so the checkpoint loads like a transformers folder
        self.train_dataset, self.eval_dataset, self.collator = train_data, eval_data, collator
        self.group_by_length = settings.group_by_length if settings.group_by_length is not None \
            else settings.batch_size > 1
        """Draw batches with :class:`~bitune.data.sampling.LengthGroupedSampler` (default: when batch_size > 1)."""
        self.is_main = self.accelerator.is_main_process
        self.state = TrainState()
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.step_hooks: list[StepHook] = []
        self.logger = JsonlLogger(Path(settings.output_dir), tensorboard) if self.is_main else None
        self._wrapped = None  # the model as trained: DDP-wrapped with several processes, or sharded in place
        self.window = Window()  # what the next log record sums up
        self._bar = None

    def add_step_hook(self, hook: StepHook) -> None:
        """Run ``hook(step, model)`` after every optimizer step (see :class:`StepHook`)."""
        self.step_hooks.append(hook)

    @property
    def wrapped(self) -> torch.nn.Module:
        """The model as trained; sharding replaces its parameters, so it is made before the optimizer."""
        if self._wrapped is None:
            if self.fsdp:
                self._wrapped = sharding.shard(self.model, self.bf16, self._reshard)
            else:
                self._wrapped = self.accelerator.prepare_model(self.model)
        return self._wrapped

    # ---------------------------------------------------------------------------------------------- data
    def train_sampler(self) -> Sampler[int]:
        """The example order: length-grouped by the global batch (``batch_size`` x processes) when
        ``group_by_length``, else uniformly shuffled; both from ``seed`` and the epoch only. It depends on the
        data's lengths, the batch and the seed, not on the method: runs of different variants, ranks or step
        counts draw the same sequence of batches (``batches`` in the log records it). With ``data_steps``, the
        first ``data_steps`` steps' examples repeated.

        Raises:
            BituneError: ``data_steps`` needs more examples than the data has.
        """
        data, s = self.train_dataset, self.settings
        group = s.batch_size * self.accelerator.num_processes if self.group_by_length else None
        sampler = parts.sampler(data, s.seed, group)
        if s.data_steps is None:
            return sampler
        needed = s.data_steps * s.batch_size * s.grad_accum * self.accelerator.num_processes
        if needed > len(data):
            raise BituneError(f"data_steps={s.data_steps} needs {needed} training examples (steps x global batch); "
                              f"the data has {len(data)}")
        return RepeatedPrefix(sampler, needed)

    def train_loader(self, sampler: Sampler[int] | None = None) -> DataLoader:
        """This process's share of the training batches (see :meth:`train_sampler`)."""
        loader = DataLoader(self.train_dataset, batch_size=self.settings.batch_size,
                            sampler=sampler if sampler is not None else self.train_sampler(),
                            collate_fn=self.collator, num_workers=self.settings.num_workers)
        return self.accelerator.prepare_data_loader(loader)

    # ---------------------------------------------------------------------------------------------- step parts
    def make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW (betas 0.9, 0.999) over exactly the model's trainable parameters; no decay on mixing thetas."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(parts.parameter_groups(self.model, self.settings.weight_decay),
                                               lr=self.settings.lr, betas=(0.9, 0.999), eps=1e-8)
        return self.optimizer

    def batch_loss(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """Example-mean loss of the batch (:class:`bitune.outputs.BituneOutput`; prompt_ids/mask (B, P),
        answer_ids/mask (B, A)).

        Raises:
            BituneError: the training loss is inf or NaN (training stops before the step is taken).
        """
        out = model(inputs["prompt_ids"], inputs["prompt_mask"], inputs["answer_ids"], inputs["answer_mask"])
        loss = out.loss  # the example mean: out.example_loss (B,) averaged
        if model.training:
            parts.check_loss(loss, self.state.global_step + 1, self._kept)
            self.window.count_positions(inputs, len(self.model.config.passes))
        return loss

    def clip_gradients(self) -> dict[str, float]:
        """Clip the trainable gradients as the settings' ``clip`` and ``max_grad_norm`` say; returns the gradient
        norms the log records (:func:`bitune.train.gradients.clip_gradients`)."""
        return clip_gradients(self.model.trainable_parameters(), self.settings.clip, self.settings.max_grad_norm)

    def _kept(self) -> str:
        """What this run, stopped because it diverged, kept (for the error's message)."""
        return kept_after_divergence(Path(self.settings.output_dir))

    def check_finite(self) -> None:
        """Refuse to save weights that hold inf or NaN.

        Raises:
            BituneError: naming a non-finite trained tensor.
        """
        bad = non_finite(self.model.trainable_parameters(), self.accelerator, self.fsdp)
        if bad:
            what = f"{len(bad)} trained tensor(s) hold inf/NaN (first: {bad[0]})"
            raise BituneError(parts.diverged(self.state.global_step + 1, what, self._kept()))

    def save_weights(self, directory: Path) -> None:
        """Write the standard Bitune checkpoint of the model into ``directory`` from the main process (every process
        calls this: sharded weights are gathered first), its model card recording this run, with the tokenizer's
        files when the trainer has one."""
        tensors = sharding.gathered(self.model.weight_tensors(), keep=self.is_main) if self.fsdp else None
        if self.is_main:
            self.model.save_pretrained(directory, tensors, self.training_record(), tokenizer=self.tokenizer)

    def training_record(self) -> Training:
        """What the model card of a checkpoint saved now records: the run's settings, data and step."""
        s = self.settings
        return Training(s.to_dict(), "bitune train", (s.dataset,), step=self.state.global_step,
                        epoch=self.state.epoch)

    # ---------------------------------------------------------------------------------------------- the loop
    def train(self, resume_from: Path | None = None) -> dict[str, float]:
        """Train for ``steps`` (or ``epochs``), optionally continuing a checkpoint; return the run's summary
        (``train_loss`` over all its steps, ``train_runtime``, ...), which is also logged."""
        s, acc = self.settings, self.accelerator
        sampler = self.train_sampler()
        loader = self.train_loader(sampler)
        steps_per_epoch = max(math.ceil(len(loader) / s.grad_accum), 1)  # len: this process's micro-batches
        total = s.steps if s.steps is not None else math.ceil(s.epochs * steps_per_epoch)
        if resume_from is not None:
            if self._wrapped is not None and self.fsdp:
                raise BituneError("resume: the model was sharded before its weights were loaded")
            self.model.load_weights(resume_from)  # before sharding: the checkpoint holds whole tensors
        _ = self.wrapped  # before the optimizer: sharding replaces the parameters it takes
        self.make_optimizer()
        self.scheduler = transformers.get_linear_schedule_with_warmup(
            self.optimizer, math.ceil(total * s.warmup_ratio), total)
        if resume_from is not None:
            self.state = TrainState(**load_checkpoint(resume_from, self.model, self.optimizer, self.scheduler,
                                                      weights=False))
        start, began = self.state.global_step, time.time()
        first_epoch, done = divmod(start, steps_per_epoch)
        if self.logger is not None:
            self.logger.open()
        self._bar = _progress(total, start, disable=not self.is_main)
        self.window.restart(acc.device)
        try:
            for epoch in range(first_epoch, math.ceil(total / steps_per_epoch)):
                resuming = resume_from if epoch == first_epoch else None
                self._run_epoch(epoch, loader, sampler, total, done if resuming else 0, resuming)
                if self.state.global_step >= total:
                    break
        finally:
            self._bar.close()
            if self.logger is not None:
                self.logger.close()
        if self.window.steps:
            self.state.loss_sum += float(acc.reduce(self.window.loss.clone(), reduction="mean"))
        runtime, steps = time.time() - began, self.state.global_step - start
        examples = steps * s.batch_size * s.grad_accum * acc.num_processes
        summary = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(examples / runtime, 3),
                   "train_steps_per_second": round(steps / runtime, 3),
                   "train_loss": self.state.loss_sum / max(self.state.global_step, 1), "epoch": self.state.epoch,
                   "torch_threads": torch.get_num_threads()}
        batches = self.window.take_batches()  # steps not yet logged
        self._log({**summary, "batches": batches} if batches else summary)
        return summary

    def _run_epoch(self, epoch: int, loader, sampler, total: int, done: int, resume_from: Path | None) -> None:
        """One pass over the data, from optimizer step ``done`` of the epoch on; ``resume_from``: the checkpoint
        whose RNG states to restore (at the point of the epoch where the interrupted run stood)."""
        s, acc = self.settings, self.accelerator
        per_epoch = len(loader)
        steps_per_epoch = max(math.ceil(per_epoch / s.grad_accum), 1)
        batches = acc.skip_first_batches(loader, done * s.grad_accum) if done else loader  # consumed before
        sampler.set_epoch(epoch)
        batches.set_epoch(epoch)
        if resume_from is not None and not done:  # at an epoch boundary: RNG first, then the epoch starts
            load_rng_state(resume_from, acc.process_index, acc.num_processes)
            resume_from = None
        micro, seen = iter(batches), done * s.grad_accum
        for update in range(done, steps_per_epoch):
            group = list(itertools.islice(micro, s.grad_accum if update < steps_per_epoch - 1
                                          else per_epoch - (steps_per_epoch - 1) * s.grad_accum))
            if resume_from is not None:  # mid-epoch: once the loader has started, as in the interrupted run
                load_rng_state(resume_from, acc.process_index, acc.num_processes)
                resume_from = None
            norms, lr = self._step(group)
            seen += len(group)
            self.state.global_step += 1
            self.state.epoch = epoch + seen / per_epoch
            self._after_step(total, norms, lr)
            if self.state.global_step >= total:
                return

    def _step(self, group: list[dict[str, torch.Tensor]]) -> tuple[dict[str, float], float]:
        """One optimizer step over the micro-batches ``group`` (gradients synced across processes on the last
        one); returns the gradient norms (:meth:`clip_gradients`) and the learning rate the step used."""
        model, acc = self.wrapped, self.accelerator
        model.train()
        self.window.batches.append(batch_digest(group))
        for i, inputs in enumerate(group):
            if self.fsdp:  # reduce-scatter once, after the last micro-batch (accumulate unsharded until then)
                model.set_requires_gradient_sync(i == len(group) - 1)
            with contextlib.nullcontext() if i == len(group) - 1 or self.fsdp else acc.no_sync(model):
                loss = self.batch_loss(model, inputs) / len(group)
                acc.backward(loss)
            self.window.loss += loss.detach()
        norms = self.clip_gradients()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        model.zero_grad()
        return norms, lr

    def _after_step(self, total: int, norms: dict[str, float], lr: float) -> None:
        """Step hooks, then log, evaluate and save as due (every checkpoint step is logged: the log is cut there)."""
        s, step, window = self.settings, self.state.global_step, self.window
        window.steps += 1
        for hook in self.step_hooks:
            hook(step, self.model)
        self._bar.update(1)
        save = s.save_every is not None and (step % s.save_every == 0 or step == total)
        if step % s.log_every == 0 or save:
            mean = float(self.accelerator.reduce(window.loss.clone(), reduction="mean")) / window.steps
            self.state.loss_sum += mean * window.steps
            window.restart()
            self._log({"loss": mean, "grad_norm": norms["grad_norm"], "lr": lr,
                       **{k: v for k, v in norms.items() if k != "grad_norm"}, **window.padding_share(),
                       "epoch": self.state.epoch, "batches": window.take_batches()})
            self._bar.set_postfix(loss=f"{mean:.4g}", refresh=False)
        if self.eval_dataset is not None and s.eval_every and (step % s.eval_every == 0 or step == total):
            self.evaluate()
        if save:
            self.check_finite()  # a diverged model never replaces a good checkpoint
            save_checkpoint(Path(s.output_dir), step, self.model, self.optimizer, self.scheduler, asdict(self.state),
                            self.accelerator, s.save_total_limit, sharded=self.fsdp, training=self.training_record())

    def evaluate(self) -> dict[str, float]:
        """``eval_loss``: the mean over the validation examples of each example's loss (logged too)."""
        began = time.time()
        loss = eval_loss(self.wrapped, self.eval_dataset, self.settings.batch_size, self.collator, self.accelerator)
        metrics = {"eval_loss": loss, "eval_runtime": round(time.time() - began, 4), "epoch": self.state.epoch}
        self._log(metrics)
        return metrics

    def _log(self, values: dict[str, float]) -> None:
        ratios = self.model.mixing_ratios()  # (L,) each
        if self.fsdp:  # the thetas are sharded: every process gathers them
            ratios = {k: sharding.full(a) for k, a in ratios.items()}
        if self.logger is not None:
            self.logger.log(self.state.global_step, values, ratios)


@dataclass
class TrainResult:
    """What a finished run produced."""

    output_dir: Path
    """The run folder."""
    final_dir: Path
    """The final model, loadable with ``BituneModel.from_pretrained``."""
    metrics: dict[str, float]
    """The run's summary (train_loss, train_runtime, eval_loss, ...)."""


def ddp_kwargs() -> DistributedDataParallelKwargs:
    """How the model is wrapped in DDP: every trainable parameter gets a gradient (tests/test_distributed.py),
    so DDP is told there are no unused parameters."""
    return DistributedDataParallelKwargs(find_unused_parameters=False)


def _progress(total: int, start: int, disable: bool):
    """A tqdm bar over the optimizer steps (time left; the latest loss as a postfix)."""
    return tqdm(total=total, initial=start, disable=disable, dynamic_ncols=True)



def resolve_bf16(setting: str) -> tuple[bool, bool]:
    """``(bf16, use_cpu)`` for a ``bf16`` setting: bf16 only on a GPU that supports it; fp32 on CPU."""
    cuda = torch.cuda.is_available()
    supported = cuda and torch.cuda.is_bf16_supported()
    if setting == "true" and not supported:
        raise BituneError("bf16=true needs a GPU with bfloat16 support; use bf16=auto (fp32 on CPU)")
    return (supported if setting == "auto" else setting == "true"), not cuda


def build_trainer(model: BituneModel, settings: TrainSettings, train_data: list[dict], eval_data: list[dict] | None,
                  collator, tensorboard: bool = True, tokenizer=None) -> BituneTrainer:
    """A :class:`BituneTrainer` for tokenized examples (the dicts :func:`bitune.data.collate.tokenize_dataset`
    makes) and a collator producing ``prompt_ids, prompt_mask, answer_ids, answer_mask``; ``tokenizer`` (optional)
    is saved in ``final/``."""
    return BituneTrainer(model, settings, train_data, eval_data, collator, tensorboard, tokenizer)


def run_training(trainer: BituneTrainer, settings: TrainSettings, resume: bool = False,
                 first_log: dict[str, Any] | None = None, overwrite: bool = False,
                 run: RunStart | None = None) -> TrainResult:
    """Train (optionally resuming from the last complete checkpoint), then save ``final/``.

    Runs the same in every process of a multi-process job: all check the run folder and train; only the main
    process holds the folder's lock and writes ``settings.yaml``, the log and ``final/``, and every process
    returns once they exist. The folder is taken by :func:`~bitune.train.run_folder.start_run` (here, or by the
    caller, which passes ``run``).

    Args:
        trainer: from :func:`build_trainer`.
        settings: the run's settings, written to ``settings.yaml``.
        resume: continue from the newest complete ``checkpoint-N`` in ``output_dir``.
        first_log: a record written to ``log.jsonl`` before training (e.g. data counts); not on resume.
        overwrite: allow replacing a run (see :func:`~bitune.train.run_folder.check_run_folder`).
        run: the folder as the caller took it with ``start_run`` (then ``resume`` and ``overwrite`` are its own).

    Raises:
        BituneError: the folder is locked by another run, holds a run this one may not replace, has nothing to
            resume, a checkpoint is corrupt, or training diverged (inf/NaN loss or weights; nothing is saved).
    """
    if run is not None:
        return _run_training(trainer, run, first_log)
    with start_run(settings.output_dir, settings, resume, overwrite, trainer.is_main) as run:
        return _run_training(trainer, run, first_log)


def _run_training(trainer: BituneTrainer, run: RunStart, first_log: dict[str, Any] | None) -> TrainResult:
    out, checkpoint = run.out, run.checkpoint
    main = trainer.is_main
    wait = trainer.accelerator.wait_for_everyone
    if checkpoint is not None:
        check_world_size(checkpoint, trainer.accelerator.num_processes)
        verify_checkpoint(checkpoint, trainer.model)
    wait()
    if main:
        run.begin()
    if main and checkpoint is not None:
        truncate_log(out / LOG_FILE, checkpoint_step(checkpoint))
        print(f"bitune train: resuming from {checkpoint}")
    elif main and first_log is not None:
        append_jsonl(out / LOG_FILE, {"step": 0, **first_log})
    wait()
    metrics = trainer.train(resume_from=checkpoint)
    if trainer.eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.check_finite()  # never write a diverged model as final/
    final = out / FINAL_DIR
    trainer.save_weights(final)  # written in a temporary folder and renamed into place
    wait()
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    return TrainResult(output_dir=out, final_dir=final, metrics=metrics)


__all__ = ["BituneTrainer", "StepHook", "TrainResult", "TrainState", "build_trainer", "run_training", "ddp_kwargs",
           "resolve_bf16"]
