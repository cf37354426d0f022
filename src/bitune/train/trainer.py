"""The training loop: a small explicit loop (torchtune style) over a :class:`~bitune.model.BituneModel`.

Built from public pieces: accelerate's ``Accelerator`` (DDP over gloo on CPU / nccl on GPUs, bf16 autocast,
sharded data loaders), a ``DataLoader`` over :mod:`bitune.data.sampling`'s seed-determined orders, AdamW over
exactly ``model.trainable_parameters()`` (no decay on the mixing thetas) and transformers' linear warmup/decay
(the parameter groups, the order and the loss check shared with TRL's trainer: :mod:`.parts`).
A step accumulates ``grad_accum`` micro-batches, clips as ``clip`` says, steps, then logs, evaluates and writes
an atomic checkpoint (:mod:`.checkpoints`) when due. ``--resume`` restores weights, optimizer, scheduler and RNG
and skips the batches already consumed in the current epoch, so a resumed run ends bit-exact on the weights of
an uninterrupted one (CPU).

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
import hashlib
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
from .checkpoints import load_checkpoint, load_rng_state, save_checkpoint, verify_checkpoint
from .logger import JsonlLogger
from .run_folder import (
    FINAL_DIR,
    LOG_FILE,
    RunStart,
    append_jsonl,
    check_world_size,
    checkpoint_step,
    checkpoints,
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
        self._positions = (0, 0)  # (real, computed) positions of the training batches since the last log
        self._window, self._window_steps = torch.zeros(()), 0  # summed step losses since the last log, steps
        self._batches: list[str] = []  # digests of the steps' batches since the last log
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
            self._count_positions(inputs)
        return loss

    def clip_gradients(self) -> dict[str, float]:
        """Clip as ``clip`` says (``all`` trainable parameters together, or only the ``adapters``) to
        ``max_grad_norm`` (0: no clipping) and return the gradient norms the log records.

        Returns:
            ``grad_norm``: the global norm of every trainable gradient before clipping; per group present
                (``causal`` and ``bidir`` adapters, ``mixer``) its norm before clipping ``grad_norm_<group>`` and
                after ``grad_norm_<group>_clipped``; ``grad_norm_adapters``: both adapter sets together, before;
                ``clip_factor``: what the clipped gradients were multiplied by (torch's ``max_grad_norm / (norm +
                1e-6)`` capped at 1; 1 without clipping). A clipped group's after-norm is ``clip_factor`` times
                its before-norm; an unclipped one's (the mixer under ``clip: adapters``) is its before-norm.
        """
        groups: dict[str, list[torch.Tensor]] = {}
        for key, p in self.model.trainable_parameters().items():  # keys "causal:...", "bidir:...", "mixer:..."
            groups.setdefault(key.partition(":")[0], []).append(p)
        adapters = [p for name in ("causal", "bidir") for p in groups.get(name, [])]
        before = {name: _norm(ps) for name, ps in groups.items()}
        everything = [p for ps in groups.values() for p in ps]
        limit, factor = self.settings.max_grad_norm, 1.0
        clipped = everything if self.settings.clip == "all" else adapters
        total = _norm(everything)
        if limit > 0 and clipped:
            norm = sharding.clip(clipped, limit)  # the clipped parameters' norm before clipping
            factor = min(1.0, limit / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_ scales
        norms = {"grad_norm": total, "clip_factor": factor}
        if adapters:
            norms["grad_norm_adapters"] = math.hypot(before.get("causal", 0.0), before.get("bidir", 0.0))
        for name, ps in groups.items():
            norms[f"grad_norm_{name}"] = before[name]
            norms[f"grad_norm_{name}_clipped"] = _norm(ps)
        return norms

    def _count_positions(self, inputs: dict[str, torch.Tensor]) -> None:
        """Add a batch's real and computed positions (the prompt counted once per prompt pass) to the window."""
        w = max(1, len(self.model.config.passes))
        pm, am = inputs["prompt_mask"], inputs["answer_mask"]  # (B, P), (B, A)
        real = w * int(pm.sum()) + int(am.sum())
        computed = w * pm.numel() + am.numel()
        self._positions = (self._positions[0] + real, self._positions[1] + computed)

    def _kept(self) -> str:
        """What a run stopped because it diverged kept, and what to change."""
        found = checkpoints(Path(self.settings.output_dir))
        kept = f"the last good checkpoint {found[-1]} is kept" if found else "no checkpoint had been written"
        return (f"stopped without saving: {kept} and no final/ is written. Lower lr, raise warmup_ratio or set "
                "max_grad_norm")

    def check_finite(self) -> None:
        """Refuse to save weights that hold inf or NaN.

        Raises:
            BituneError: naming a non-finite trained tensor.
        """
        params = self.model.trainable_parameters()
        bad = [k for k, p in params.items() if not bool(torch.isfinite(sharding.local(p.detach())).all())]
        if self.fsdp:  # each process checks its shards; all stop together
            flags = self.accelerator.reduce(torch.tensor([k in bad for k in params], device=self.accelerator.device,
                                                         dtype=torch.int32), reduction="sum")
            bad = [k for k, f in zip(params, flags.tolist()) if f]
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
        self._window, self._window_steps = torch.zeros((), device=acc.device), 0  # step losses since the last log
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
        if self._window_steps:
            self.state.loss_sum += float(acc.reduce(self._window.clone(), reduction="mean"))
        runtime, steps = time.time() - began, self.state.global_step - start
        examples = steps * s.batch_size * s.grad_accum * acc.num_processes
        summary = {"train_runtime": round(runtime, 4), "train_samples_per_second": round(examples / runtime, 3),
                   "train_steps_per_second": round(steps / runtime, 3),
                   "train_loss": self.state.loss_sum / max(self.state.global_step, 1), "epoch": self.state.epoch,
                   "torch_threads": torch.get_num_threads()}
        self._log({**summary, "batches": self._batches} if self._batches else summary)  # steps not yet logged
        self._batches = []
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
        self._batches.append(batch_digest(group))
        for i, inputs in enumerate(group):
            if self.fsdp:  # reduce-scatter once, after the last micro-batch (accumulate unsharded until then)
                model.set_requires_gradient_sync(i == len(group) - 1)
            with contextlib.nullcontext() if i == len(group) - 1 or self.fsdp else acc.no_sync(model):
                loss = self.batch_loss(model, inputs) / len(group)
                acc.backward(loss)
            self._window += loss.detach()
        norms = self.clip_gradients()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        model.zero_grad()
        return norms, lr

    def _after_step(self, total: int, norms: dict[str, float], lr: float) -> None:
        """Step hooks, then log, evaluate and save as due (every checkpoint step is logged: the log is cut there)."""
        s, step = self.settings, self.state.global_step
        self._window_steps += 1
        for hook in self.step_hooks:
            hook(step, self.model)
        self._bar.update(1)
        save = s.save_every is not None and (step % s.save_every == 0 or step == total)
        if step % s.log_every == 0 or save:
            mean = float(self.accelerator.reduce(self._window.clone(), reduction="mean")) / self._window_steps
            self.state.loss_sum += mean * self._window_steps
            self._window.zero_()
            self._window_steps = 0
            self._log({"loss": mean, "grad_norm": norms["grad_norm"], "lr": lr,
                       **{k: v for k, v in norms.items() if k != "grad_norm"}, **self._padding_share(),
                       "epoch": self.state.epoch, "batches": self._batches})
            self._batches = []
            self._bar.set_postfix(loss=f"{mean:.4g}", refresh=False)
        if self.eval_dataset is not None and s.eval_every and (step % s.eval_every == 0 or step == total):
            self.evaluate()
        if save:
            self.check_finite()  # a diverged model never replaces a good checkpoint
            save_checkpoint(Path(s.output_dir), step, self.model, self.optimizer, self.scheduler, asdict(self.state),
                            self.accelerator, s.save_total_limit, sharded=self.fsdp, training=self.training_record())

    def evaluate(self) -> dict[str, float]:
        """``eval_loss``: the mean over the validation examples of each example's loss (logged too)."""
        acc = self.accelerator
        loader = acc.prepare_data_loader(DataLoader(self.eval_dataset, batch_size=self.settings.batch_size,
                                                    shuffle=False, collate_fn=self.collator))
        model, began, losses = self.wrapped, time.time(), []
        model.eval()
        with torch.no_grad():
            for b in loader:
                out = model(b["prompt_ids"], b["prompt_mask"], b["answer_ids"], b["answer_mask"])
                losses.append(acc.gather_for_metrics(out.example_loss.detach().float()))  # (B * processes,)
        model.train()
        metrics = {"eval_loss": float(torch.cat(losses).mean()), "eval_runtime": round(time.time() - began, 4),
                   "epoch": self.state.epoch}
        self._log(metrics)
        return metrics

    def _padding_share(self) -> dict[str, float]:
        real, computed = self._positions
        self._positions = (0, 0)
        return {"padding_share": round(1.0 - real / computed, 4)} if computed else {}

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


def batch_digest(group: list[dict[str, torch.Tensor]]) -> str:
    """A 12-hex-digit digest of one optimizer step's examples (this process's micro-batches): each row's real
    prompt and answer tokens, in order, padding left out. Two runs took the same batches at a step exactly when
    their digests agree (``log.jsonl``'s ``batches``: one digest per step since the previous record)."""
    h = hashlib.blake2b(digest_size=6)
    for inputs in group:
        rows = zip(inputs["prompt_ids"], inputs["prompt_mask"], inputs["answer_ids"], inputs["answer_mask"])
        for pi, pm, ai, am in rows:
            for ids, mask in ((pi, pm), (ai, am)):
                h.update(ids[mask.bool()].to(torch.int64).cpu().numpy().tobytes())
                h.update(b"|")
    return h.hexdigest()


def _norm(params: list[torch.Tensor]) -> float:
    """Global L2 norm of the gradients of ``params`` (0 when none has a gradient; sharded ones reduced)."""
    return sharding.total_norm(params)


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
           "resolve_bf16", "batch_digest"]
