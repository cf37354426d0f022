"""Training on transformers' ``Trainer``: the loss is a :class:`~bitune.model.BituneModel` forward.

The subclass changes only what is Bitune-specific: the loss (prompt/answer batches), the optimizer (AdamW
over exactly ``model.trainable_parameters()``), checkpoints (our ``save_pretrained``: safetensors + JSON,
written into a staging folder and renamed into place) and resuming (strict ``load_weights``). Everything
else (schedule, clipping, accumulation, seeding, autocast, resumable data order) is Trainer's own.

The loss is the **example mean**: each example's mean answer-token cross-entropy, averaged over the examples
of the batch (every example weighs the same, whatever its length: the authors' batch-1 x accumulation setup).
With ``N`` processes (``torchrun`` / ``accelerate launch`` / ``bitune train --num-processes N``) Trainer
wraps the model in ``DistributedDataParallel``, each process takes its own ``batch_size`` examples and DDP
averages the gradients, so N processes x ``batch_size`` b give the update of one process with batch N x b
(exactly, since every process holds b examples; only a short last batch of an epoch weighs its examples
differently). Logging, checkpoints and the final model are written by the main process only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_pt_utils import safe_globals

from ..errors import BituneError
from ..files import replace_dir, write_text_atomic
from ..checkpoint import read_config
from ..model import BituneModel
from .run_folder import (CHECKPOINT_PREFIX, FINAL_DIR, LOG_FILE, SETTINGS_FILE, STATE_FILE, TB_DIR,
                         check_run_folder, checkpoint_step, checkpoints, clear_run, run_lock)
from .settings import TrainSettings


class BituneTrainer(Trainer):
    """``Trainer`` whose model is a :class:`BituneModel` fed by :class:`bitune.data.collate.Collator` batches."""

    _staging: Path | None = None
    _keep: int | None = None
    group_by_length: bool = False
    """Draw training batches with :class:`bitune.data.sampling.LengthGroupedSampler` (set by build_trainer)."""
    clip: str = "all"
    """What ``max_grad_norm`` clips: ``"all"`` trainable parameters together, or only the ``"adapters"``."""
    _group_norms: dict[str, float] | None = None
    _positions = (0, 0)  # (real, computed) positions of the training batches since the last log
    _resume_step = 0  # the step of the checkpoint this run resumed from (0: a fresh run)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Example-mean loss of the batch: the mean over its B examples of each example's mean answer-token
        cross-entropy (prompt_ids/mask (B, P), answer_ids/mask (B, A)); see the module docstring.

        Raises:
            BituneError: the training loss is inf or NaN (training stops before the step is taken).
        """
        out = model(inputs["prompt_ids"], inputs["prompt_mask"], inputs["answer_ids"], inputs["answer_mask"])
        loss = out.loss  # the example mean: out.example_loss (B,) averaged
        if model.training:
            if not torch.isfinite(loss.detach()):
                raise BituneError(self._diverged(f"the training loss is {float(loss.detach())}"))
            self._count_positions(inputs)
        return (loss, out) if return_outputs else loss

    def _diverged(self, what: str) -> str:
        """The message of a run stopped because it diverged: what happened and what was kept."""
        found = checkpoints(Path(self.args.output_dir))
        kept = f"the last good checkpoint {found[-1]} is kept" if found else "no checkpoint had been written"
        return (f"training diverged at step {self.state.global_step + 1}: {what}; stopped without saving: {kept} "
                "and no final/ is written. Lower lr, raise warmup_ratio or set max_grad_norm")

    def check_finite(self) -> None:
        """Refuse to save weights that hold inf or NaN.

        Raises:
            BituneError: naming a non-finite trained tensor.
        """
        bad = [k for k, p in self.model.trainable_parameters().items() if not bool(torch.isfinite(p).all())]
        if bad:
            raise BituneError(self._diverged(f"{len(bad)} trained tensor(s) hold inf/NaN (first: {bad[0]})"))

    def _count_positions(self, inputs: dict[str, torch.Tensor]) -> None:
        """Add a batch's real and computed positions (the prompt counted once per prompt pass) to the window."""
        w = max(1, len(self.model.config.passes))
        pm, am = inputs["prompt_mask"], inputs["answer_mask"]  # (B, P), (B, A)
        real = w * int(pm.sum()) + int(am.sum())
        computed = w * pm.numel() + am.numel()
        self._positions = (self._positions[0] + real, self._positions[1] + computed)

    def _get_train_sampler(self, train_dataset=None):
        """Length-grouped, seed-determined order when ``group_by_length``; otherwise Trainer's own sampler."""
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if not self.group_by_length or dataset is None:
            return super()._get_train_sampler(train_dataset)
        from ..data.sampling import LengthGroupedSampler

        lengths = [(len(s["prompt_ids"]), len(s["answer_ids"])) for s in dataset]
        # Grouped by the global batch: accelerate hands consecutive per-process batches to processes 0..N-1, so
        # N processes take the same examples per step as one process with batch N x batch_size.
        group = self.args.per_device_train_batch_size * self.args.world_size
        return LengthGroupedSampler(lengths, group, seed=self.args.data_seed)

    # ----------------------------------------------------------------------------------- gradient norm / clipping
    def _grad_groups(self) -> dict[str, list[torch.Tensor]]:
        params = self.model.trainable_parameters()
        return {"adapters": [p for k, p in params.items() if not k.startswith("mixer:")],
                "mixer": [p for k, p in params.items() if k.startswith("mixer:")]}

    def _measure_groups(self) -> dict[str, list[torch.Tensor]]:
        groups = self._grad_groups()
        self._group_norms = {name: _norm(ps) for name, ps in groups.items() if ps}
        return groups

    def _clip_grad_norm(self, model):
        """Clip as ``clip`` says; record the adapters' and the mixer's gradient norms before clipping.

        Returns the pre-clip norm of all trainable parameters (what Trainer logs as ``grad_norm``).
        """
        if self.is_fsdp_enabled:  # sharded gradients: only Trainer's own joint clipping is correct
            return super()._clip_grad_norm(model)
        groups = self._measure_groups()
        if self.clip == "adapters":
            total = _norm(groups["adapters"] + groups["mixer"])
            torch.nn.utils.clip_grad_norm_(groups["adapters"], self.args.max_grad_norm)
            return total
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None and not self.is_fsdp_enabled:
            self._measure_groups()
        return super()._get_grad_norm(model, grad_norm)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's log, plus on training records: the last step's gradient norm per group (before clipping)
        and the padding share of the batches since the previous log; a resumed run's ``train_loss`` summary is
        the mean over all its steps (see :meth:`_full_run_loss`)."""
        if "train_loss" in logs and self._resume_step:
            logs.update(self._full_run_loss(logs.pop("train_loss")))
        if "loss" in logs and "eval_loss" not in logs:
            for name, value in (self._group_norms or {}).items():
                logs[f"grad_norm_{name}"] = value
            real, computed = self._positions
            if computed:
                logs["padding_share"] = round(1.0 - real / computed, 4)
            self._positions = (0, 0)
        super().log(logs, start_time)

    def _full_run_loss(self, since_resume: float) -> dict[str, float]:
        """``train_loss`` over every step of a resumed run, from Trainer's mean over the steps run since the
        resume and the losses logged before it (every checkpoint step is logged, see :class:`LogAtSave`, so
        those records cover steps 1..resume step exactly). A checkpoint written without that record gives
        ``train_loss_since_resume`` instead."""
        start, end = self._resume_step, self.state.global_step
        records = sorted((r["step"], r["loss"]) for r in self.state.log_history if "loss" in r and r["step"] <= start)
        if not records or records[-1][0] != start:
            return {"train_loss_since_resume": since_resume}
        steps = [0, *(step for step, _ in records)]
        before = sum(loss * (step - prev) for (step, loss), prev in zip(records, steps))
        return {"train_loss": (before + since_resume * (end - start)) / max(end, 1)}

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Validation: the loss only."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """AdamW (betas 0.9, 0.999) over exactly the model's trainable parameters; no decay on mixing thetas."""
        if self.optimizer is None:
            params = list(self.model.trainable_parameters().values())
            if not params:
                raise BituneError(f"variant {self.model.config.variant!r} has no trainable parameters")
            mixer = {id(p) for p in self.model.mixer.parameters()} if self.model.mixer is not None else set()
            groups = [{"params": [p for p in params if id(p) not in mixer], "weight_decay": self.args.weight_decay},
                      {"params": [p for p in params if id(p) in mixer], "weight_decay": 0.0}]
            self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.args.learning_rate,
                                               betas=(self.args.adam_beta1, self.args.adam_beta2),
                                               eps=self.args.adam_epsilon)
        return self.optimizer

    # ------------------------------------------------------------------------------------------- checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the model with ``BituneModel.save_pretrained`` (safetensors + JSON, no pickles); main process only.

        Under FSDP (every process calls this) the sharded weights are first gathered onto the main process.
        """
        target = output_dir or self.args.output_dir
        if not self.is_fsdp_enabled:
            if self.args.should_save:
                self.model.save_pretrained(target)
            return
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.model_wrapped, writeback=False, rank0_only=True):
            if self.args.should_save:
                self.accelerator.unwrap_model(self.model).save_pretrained(target)

    def _get_output_dir(self, trial) -> str:
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """Write the whole checkpoint (model, optimizer, scheduler, RNG, state) in a staging folder, then
        rename it into place, so ``checkpoint-N`` either is complete or does not exist.

        With several processes every one writes its ``rng_state_<rank>.pth`` into the staging folder; only the
        main process writes the rest, renames and rotates, and the others wait at barriers around it.
        """
        self.check_finite()  # a diverged model never replaces a good checkpoint
        root = Path(self.args.output_dir)
        name = f"{CHECKPOINT_PREFIX}{self.state.global_step}"
        main = self.args.should_save
        self._staging = root / f".staging-{name}"
        if main:
            shutil.rmtree(self._staging, ignore_errors=True)
        self.accelerator.wait_for_everyone()  # nobody writes into the staging folder before it is clean
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every rank's files are in the staging folder
            if main:
                replace_dir(self._staging / name, root / name)
        finally:
            if main:
                shutil.rmtree(self._staging, ignore_errors=True)
            self._staging = None
        if main:
            _rotate(root, self._keep)
        self.accelerator.wait_for_everyone()  # checkpoint-N exists for every rank once this returns

    def _save_rng_state(self, output_dir: str) -> None:
        """Each process's RNG state, written once the main process has saved the model: its
        ``save_pretrained`` replaces the whole folder, which would drop a file written before it."""
        self.accelerator.wait_for_everyone()
        super()._save_rng_state(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Strictly load the checkpoint's weights (the config must match this run's)."""
        self._resume_step = checkpoint_step(Path(resume_from_checkpoint))
        saved = read_config(Path(resume_from_checkpoint))
        if saved != self.model.config:
            raise BituneError(f"{resume_from_checkpoint} was trained with {saved}, this run uses "
                              f"{self.model.config}; use a new output_dir for a different model")
        self.model.load_weights(resume_from_checkpoint)


class JsonlLogger(TrainerCallback):
    """Every log event to ``log.jsonl`` (one JSON object per line) and TensorBoard, with per-layer a_k / a_v."""

    def __init__(self, output_dir: Path, tensorboard: bool = True):
        self.path = output_dir / LOG_FILE
        self.tb_dir = output_dir / TB_DIR
        self.use_tb = tensorboard
        self.writer = None
        self.start = time.time()

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if self.use_tb and self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                print("bitune train: tensorboard is not installed; logging to log.jsonl only")
                self.use_tb = False
            else:
                self.writer = SummaryWriter(str(self.tb_dir))

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        record: dict[str, Any] = {"step": state.global_step}
        for k, v in (logs or {}).items():
            if isinstance(v, (int, float)):
                record["lr" if k == "learning_rate" else k] = v
        if model is not None:
            for k, ratios in model.mixing_ratios().items():  # (L,) each
                record[f"a_{k}"] = [round(float(a), 6) for a in ratios]
        record["elapsed_s"] = round(time.time() - self.start, 2)
        append_jsonl(self.path, record)
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(f"train/{k}", v, state.global_step)
                elif isinstance(v, list):
                    for i, a in enumerate(v):
                        self.writer.add_scalar(f"mixing/{k}/layer_{i:02d}", a, state.global_step)
            self.writer.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class LogAtSave(TrainerCallback):
    """Log the training loss at every checkpoint step too, so the log up to a checkpoint covers all its steps
    (a resumed run's ``train_loss`` summary is then exact, and ``log.jsonl`` is cut exactly at the checkpoint)."""

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            control.should_log = True


class LossProgress(ProgressCallback):
    """Trainer's tqdm bar (steps, time left) with the latest loss as a postfix instead of printed dicts."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.training_bar is not None and logs:
            shown = {k: f"{logs[k]:.4g}" for k in ("loss", "eval_loss") if isinstance(logs.get(k), float)}
            if shown:
                self.training_bar.set_postfix(shown, refresh=False)


@dataclass
class TrainResult:
    """What a finished run produced."""

    output_dir: Path
    """The run folder."""
    final_dir: Path
    """The final model, loadable with ``BituneModel.from_pretrained``."""
    metrics: dict[str, float]
    """Trainer's summary (train_loss, train_runtime, ...)."""


def training_arguments(settings: TrainSettings, bf16: bool, use_cpu: bool) -> TrainingArguments:
    """The ``TrainingArguments`` a :class:`TrainSettings` stands for."""
    return TrainingArguments(
        output_dir=settings.output_dir,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.grad_accum,
        learning_rate=settings.lr,
        weight_decay=settings.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        max_grad_norm=settings.max_grad_norm,
        max_steps=settings.steps if settings.steps is not None else -1,
        num_train_epochs=settings.epochs,
        lr_scheduler_type="linear",
        warmup_steps=settings.warmup_ratio,  # < 1: a fraction of the total steps
        logging_strategy="steps",
        logging_steps=settings.log_every,
        eval_strategy="steps" if settings.eval_every else "no",
        eval_steps=settings.eval_every,
        prediction_loss_only=True,
        save_strategy="steps" if settings.save_every else "no",
        save_steps=settings.save_every or 500,
        save_total_limit=None,  # rotation is done after the atomic rename, see BituneTrainer._save_checkpoint
        seed=settings.seed,
        data_seed=settings.seed,
        bf16=bf16,
        use_cpu=use_cpu,
        report_to="none",
        remove_unused_columns=False,
        dataloader_num_workers=settings.num_workers,
        disable_tqdm=False,
        label_names=[],
        ddp_find_unused_parameters=False,  # every trainable parameter gets a gradient (tests/test_distributed.py)
        ddp_backend="gloo" if use_cpu and world_size() > 1 else None,  # None: nccl on GPUs
    )


def _norm(params: list[torch.Tensor]) -> float:
    """Global L2 norm of the gradients of ``params`` (0 when none has a gradient)."""
    grads = [p.grad.detach().float().norm() for p in params if p.grad is not None]
    return float(torch.stack(grads).norm()) if grads else 0.0


def world_size() -> int:
    """Processes of this job, as the launcher (``torchrun``, ``accelerate launch``) set them; 1 when not launched."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_bf16(setting: str) -> tuple[bool, bool]:
    """``(bf16, use_cpu)`` for a ``bf16`` setting: bf16 only on a GPU that supports it; fp32 on CPU."""
    cuda = torch.cuda.is_available()
    supported = cuda and torch.cuda.is_bf16_supported()
    if setting == "true" and not supported:
        raise BituneError("bf16=true needs a GPU with bfloat16 support; use bf16=auto (fp32 on CPU)")
    return (supported if setting == "auto" else setting == "true"), not cuda


def build_trainer(model: BituneModel, settings: TrainSettings, train_data: list[dict], eval_data: list[dict] | None,
                  collator, tensorboard: bool = True) -> BituneTrainer:
    """A :class:`BituneTrainer` for tokenized examples (the dicts :func:`bitune.data.collate.tokenize_dataset`
    makes) and a collator producing ``prompt_ids, prompt_mask, answer_ids, answer_mask``."""
    if model.config.variant == "pretrained":
        raise BituneError("bitune.variant='pretrained' trains nothing; pick a trainable variant")
    bf16, use_cpu = resolve_bf16(settings.bf16)
    args = training_arguments(settings, bf16, use_cpu)
    trainer = BituneTrainer(model=model, args=args, train_dataset=train_data, eval_dataset=eval_data,
                            data_collator=collator,
                            callbacks=[JsonlLogger(Path(settings.output_dir), tensorboard), LogAtSave()])
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(LossProgress())
    trainer._keep = settings.save_total_limit
    trainer.group_by_length = settings.group_by_length if settings.group_by_length is not None \
        else settings.batch_size > 1
    trainer.clip = settings.clip
    if trainer.clip != "all" and trainer.is_fsdp_enabled:
        raise BituneError(f"clip={settings.clip!r} is not supported under FSDP (sharded gradients); use clip=all")
    return trainer


def run_training(trainer: BituneTrainer, settings: TrainSettings, resume: bool = False,
                 first_log: dict[str, Any] | None = None, overwrite: bool = False) -> TrainResult:
    """Train (optionally resuming from the last complete checkpoint), then save ``final/``.

    Runs the same in every process of a multi-process job: all check the run folder and train; only the main
    process holds the folder's lock (:func:`~bitune.train.run_folder.run_lock`) and writes ``settings.yaml``,
    the log and ``final/``, and every process returns once they exist.

    Args:
        trainer: from :func:`build_trainer`.
        settings: the run's settings, written to ``settings.yaml``.
        resume: continue from the newest complete ``checkpoint-N`` in ``output_dir``.
        first_log: a record written to ``log.jsonl`` before training (e.g. data counts); not on resume.
        overwrite: allow replacing a run (see :func:`~bitune.train.run_folder.check_run_folder`).

    Raises:
        BituneError: the folder is locked by another run, holds a run this one may not replace, has nothing to
            resume, a checkpoint is corrupt, or training diverged (inf/NaN loss or weights; nothing is saved).
    """
    out = Path(settings.output_dir)
    main = trainer.args.should_save
    with run_lock(out) if main else contextlib.nullcontext():
        return _run_training(trainer, settings, resume, first_log, overwrite)


def _run_training(trainer: BituneTrainer, settings: TrainSettings, resume: bool, first_log: dict[str, Any] | None,
                  overwrite: bool) -> TrainResult:
    out = Path(settings.output_dir)
    main = trainer.args.should_save
    wait = trainer.accelerator.wait_for_everyone
    checkpoint = prepare_output_dir(out, settings, resume, write=False, overwrite=overwrite)  # all check first
    if checkpoint is not None:
        check_world_size(checkpoint, trainer.args.world_size)
        verify_checkpoint(checkpoint, trainer.model)
    wait()
    if main:
        prepare_output_dir(out, settings, resume, overwrite=overwrite)
    if main and checkpoint is not None:
        truncate_log(out / LOG_FILE, checkpoint_step(checkpoint))
        print(f"bitune train: resuming from {checkpoint}")
    elif main and first_log is not None:
        append_jsonl(out / LOG_FILE, {"step": 0, **first_log})
    wait()
    result = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    metrics = dict(result.metrics)
    if trainer.eval_dataset is not None:
        metrics.update(trainer.evaluate())
    trainer.check_finite()  # never write a diverged model as final/
    final = out / FINAL_DIR
    trainer.save_model(str(final))  # every process calls it; the main one writes
    wait()
    metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    return TrainResult(output_dir=out, final_dir=final, metrics=metrics)


# --------------------------------------------------------------------------------------------------- run folder
def prepare_output_dir(out: Path, settings: TrainSettings, resume: bool, write: bool = True,
                       overwrite: bool = False) -> Path | None:
    """Check the run folder against this run (:func:`~bitune.train.run_folder.check_run_folder`) and write
    ``settings.yaml``; return the checkpoint to resume from. ``write=False`` only checks; with ``overwrite`` and
    without ``resume`` the old run is deleted first."""
    checkpoint = check_run_folder(out, settings, resume, overwrite)
    if not write:
        return checkpoint
    if overwrite and not resume:
        clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / SETTINGS_FILE, settings.to_yaml())
    return checkpoint


def verify_checkpoint(path: Path, model: BituneModel | None = None) -> None:
    """Read every file of a checkpoint before training resumes, so corruption fails early with its name.

    Args:
        path: the ``checkpoint-N`` folder.
        model: when given, its weights are loaded from the checkpoint (strictly) as part of the check.
    """
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise BituneError(f"corrupt checkpoint file {path / STATE_FILE}: {e}") from e
    rng = sorted(p.name for p in path.glob("rng_state*.pth"))
    for name in ("optimizer.pt", "scheduler.pt", *(rng or ["rng_state.pth"])):
        if not (path / name).is_file():
            raise BituneError(f"checkpoint {path} is incomplete: {name} is missing")
        try:
            with safe_globals():  # the numpy types Trainer's own loader allows in the RNG state
                torch.load(path / name, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several unrelated types for a damaged file
            raise BituneError(f"corrupt checkpoint file {path / name}: {type(e).__name__}") from e
    read_config(path)
    if model is not None:
        try:
            model.load_weights(path)
        except BituneError:
            raise
        except ValueError as e:
            raise BituneError(str(e)) from e


def checkpoint_world_size(path: Path) -> int:
    """How many processes wrote a checkpoint: one ``rng_state.pth``, or ``rng_state_<rank>.pth`` per process."""
    per_rank = list(Path(path).glob("rng_state_*.pth"))
    return len(per_rank) if per_rank else 1


def check_world_size(path: Path, world_size: int) -> None:
    """Refuse to resume with another process count: the global batch (and so the run) would change."""
    saved = checkpoint_world_size(path)
    if saved != world_size:
        raise BituneError(f"{path} was written by {saved} process(es), this run has {world_size}: the global "
                          f"batch would change; resume with --num-processes {saved} or choose another output_dir")


def truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after ``step`` by an interrupted run (they are logged again on resume)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except json.JSONDecodeError:
            continue  # a line cut off by the interruption
    write_text_atomic(path, "".join(f"{line}\n" for line in kept))


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _rotate(root: Path, keep: int | None) -> None:
    if keep is None:
        return
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


__all__ = ["BituneTrainer", "JsonlLogger", "TrainResult", "build_trainer", "run_training", "checkpoints",
           "training_arguments", "resolve_bf16", "verify_checkpoint", "check_world_size"]
