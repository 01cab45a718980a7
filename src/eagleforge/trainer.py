"""The Trainer: takes built components and runs the training loop.

Each optimizer step runs the target on ``grad_accum_steps`` micro-batches, counts the loss
positions of the whole step on every rank (one all-reduce), then runs the unrolled TTT and
backward per micro-batch with the loss normalised by that global count -- so the result does
not depend on padding, on how the step is split into micro-batches, or on the number of
ranks. Gradients are reduced once, after the step's last backward. Eval, checkpoints and
metrics happen on the step boundaries configured; every rank takes part in them, rank 0 logs
and writes. The last step's checkpoint is written after the final eval, so a run resumed at
its last step has nothing left to do.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.tensor import DTensor

from eagleforge.checkpoint import TRAINING_STATE, load_checkpoint, read_history, save_checkpoint
from eagleforge.draft.family import AnyBatch, AnyDraft, TrainingModule
from eagleforge.draft.ttt import PositionStats, simulated_acceptance_length
from eagleforge.errors import ConfigError, InputsStopped
from eagleforge.parallel.dist import World
from eagleforge.parallel.fsdp import full_draft_state, set_gradient_sync
from eagleforge.precision import Precision, choose
from eagleforge.profiling import ProfileConfig, StepProfiler, peak_memory_mib
from eagleforge.progress import Progress
from eagleforge.tracking import Tracker

log = logging.getLogger(__name__)


class ComputeDType(str, Enum):
    """Dtype of the draft's forward and backward (autocast; the weights keep their dtype)."""

    auto = "auto"  # bfloat16 on CUDA and on a CPU with native bf16, else float32 (precision.py)
    float32 = "float32"
    bfloat16 = "bfloat16"

    def choice(self, device: torch.device, *, say: bool = True) -> Precision:
        """This dtype on ``device``, and why (said once per process)."""
        return choose("trainer.compute_dtype", self.value, device, say=say)


@dataclass
class TrainerConfig:
    """The `trainer` config section."""

    # Sequences per micro-batch when not packing (with packing a micro-batch is one packed row).
    batch_size: int = 1
    # Micro-batches per optimizer step (gradient accumulation).
    grad_accum_steps: int = 1
    # Passes over the training data (used when max_num_steps is null).
    num_epochs: int = 1
    # Optimizer steps to run; null = num_epochs x steps per epoch.
    max_num_steps: int | None = None
    # Log train metrics every N optimizer steps (averaged over the window).
    log_every_n_steps: int = 10
    # Evaluate on the held-out data every N optimizer steps (0 = only at the end).
    eval_every_n_steps: int = 0
    # Also evaluate before the first step (the untrained baseline).
    eval_at_start: bool = True
    # Save a checkpoint every N optimizer steps (0 = only at the end).
    save_every_n_steps: int = 0
    # Keep only the newest N step checkpoints (checkpoints/best is always kept); null = all.
    keep_last_n: int | None = None
    # Measure the real acceptance length τ by speculative decoding (eval.* decoding settings,
    # eval.prompts) every N optimizer steps and at the end; the checkpoint with the best τ is
    # kept in checkpoints/best. 0 = off.
    eval_tau_every_n_steps: int = 0
    # Prompts (first turns) used for that measurement.
    eval_tau_prompts: int = 4
    # Show a tqdm progress bar.
    progress_bar: bool = True
    # The draft's compute dtype under autocast (weights and optimizer state keep
    # optimizer.fp32_master's): auto = bfloat16 on CUDA and on a CPU with bf16 matrix units
    # (avx512_bf16, AMX; ~1.4x faster there), float32 on other CPUs (bf16 ~25x slower there).
    compute_dtype: ComputeDType = ComputeDType.auto
    # auto: continue from the newest complete checkpoint in output_dir/checkpoints, if any
    # (weights, optimizer, scheduler, RNG and data position: the run goes on exactly as if
    # never stopped); never: always start fresh; or the path of a checkpoint to continue from.
    resume: str = "auto"

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum_steps", "num_epochs", "log_every_n_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"trainer.{name} must be >= 1, got {getattr(self, name)}.")
        if self.max_num_steps is not None and self.max_num_steps < 1:
            raise ConfigError(
                f"trainer.max_num_steps must be >= 1 or null, got {self.max_num_steps}."
            )
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ConfigError(f"trainer.keep_last_n must be >= 1 or null, got {self.keep_last_n}.")
        if self.eval_tau_prompts < 1:
            raise ConfigError(
                f"trainer.eval_tau_prompts must be >= 1, got {self.eval_tau_prompts}."
            )
        for name in ("eval_every_n_steps", "save_every_n_steps", "eval_tau_every_n_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"trainer.{name} must be >= 0, got {getattr(self, name)}.")


@dataclass
class StepSums:
    """Per-TTT-step sums over any number of micro-batches."""

    loss_sum_k: torch.Tensor
    num_counted_k: torch.Tensor
    num_correct_k: torch.Tensor
    alpha_sum_k: torch.Tensor  # Σ expected acceptance over counted positions (PositionStats)
    num_tokens: int = 0

    @classmethod
    def zeros(cls, num_positions: int) -> StepSums:
        return cls(
            torch.zeros(num_positions, dtype=torch.float64),
            torch.zeros(num_positions, dtype=torch.long),
            torch.zeros(num_positions, dtype=torch.long),
            torch.zeros(num_positions, dtype=torch.float64),
        )

    def add(self, stats: PositionStats | StepSums, tokens: int) -> None:
        """Add one micro-batch's stats (or another window's sums) covering ``tokens`` tokens."""
        self.loss_sum_k += stats.loss_sum_k.detach().double().cpu()
        self.num_counted_k += stats.num_counted_k.cpu()
        self.num_correct_k += stats.num_correct_k.cpu()
        self.alpha_sum_k += stats.alpha_sum_k.detach().double().cpu()
        self.num_tokens += tokens

    def summed_over(self, world: World) -> StepSums:
        """The sums of every rank (one collective)."""
        if not world.distributed:
            return self
        k = len(self.loss_sum_k)
        packed = torch.cat(
            [
                self.loss_sum_k,
                self.num_counted_k.double(),
                self.num_correct_k.double(),
                self.alpha_sum_k,
                torch.tensor([float(self.num_tokens)], dtype=torch.float64),
            ]
        )
        total = world.all_reduce_sum(packed)
        return StepSums(
            total[:k],
            total[k : 2 * k].round().long(),
            total[2 * k : 3 * k].round().long(),
            total[3 * k : 4 * k],
            int(total[-1].item()),
        )

    def metrics(self, prefix: str, weights_k: torch.Tensor) -> dict[str, float]:
        counts = self.num_counted_k.clamp(min=1)
        loss_k = self.loss_sum_k / counts
        acc_k = (self.num_correct_k.double() / counts).tolist()
        # the sums live on the CPU, the weights on the training device
        out = {f"{prefix}/loss": float((weights_k.detach().double().cpu() * loss_k).sum())}
        out.update({f"{prefix}/loss_{i}": float(v) for i, v in enumerate(loss_k.tolist())})
        out.update({f"{prefix}/acc_{i}": float(v) for i, v in enumerate(acc_k)})
        alpha_k = (self.alpha_sum_k / counts).tolist()
        out.update({f"{prefix}/alpha_{i}": float(v) for i, v in enumerate(alpha_k)})
        out[f"{prefix}/tau_sim"] = simulated_acceptance_length(acc_k)
        out[f"{prefix}/num_counted_0"] = float(self.num_counted_k[0])
        return out


@dataclass
class TrainResult:
    step: int
    final_eval: dict[str, float] = field(default_factory=dict)
    initial_eval: dict[str, float] = field(default_factory=dict)
    train_losses: list[float] = field(default_factory=list)
    checkpoint: Path | None = None
    tau_by_step: dict[int, float] = field(default_factory=dict)  # real τ measurements
    # every evaluation's metrics by step (the learning curve; initial_eval is step 0's)
    eval_by_step: dict[int, dict[str, float]] = field(default_factory=dict)
    preempted_by: int | None = None  # the signal that stopped the run early
    best_checkpoint: Path | None = None  # the checkpoint with the best real τ
    already_complete: bool = False  # resumed at its last step: nothing was done again


class StopSignals:
    """While active, the signals that announce the end of a job are recorded instead of
    killing the process, so the loop can finish its step and save: SIGTERM (SLURM's
    preemption, scancel), SIGUSR1 (``sbatch --signal``), SIGUSR2 (what submitit asks
    SLURM to send before the time limit, and on preemption where SLURM sends it) and SIGINT
    (Ctrl-C; a second Ctrl-C raises KeyboardInterrupt at once, and the entry point exits
    without saving). Only in the main thread; the handlers found on entry are put back on
    exit, and ``hand_on`` gives them the recorded signal once the run has saved."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
    # submitit's checkpoint-and-requeue signal: once recorded, a later SIGTERM (the rest of
    # a preemption) does not replace it, so the job is still requeued.
    REQUEUE = signal.SIGUSR2

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            if self.signal == signal.SIGINT:  # the second Ctrl-C: stop now
                raise KeyboardInterrupt
            # os.write: a print here could interrupt a print of the loop's (tqdm's)
            os.write(2, b"\nCtrl-C: finishing this step, then saving a checkpoint and "
                        b"exiting; Ctrl-C again stops at once without saving.\n")  # fmt: skip
        if self.signal != self.REQUEUE:
            self.signal = signum

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @staticmethod
    def hand_on(signum: int) -> None:
        """After the run stopped and saved: call the Python handler now installed for
        ``signum`` (the one found on entry), if any. Inside a submitit job that is submitit's:
        on SIGUSR2 it requeues the job (``scontrol requeue``) and exits; on SIGTERM it only
        logs. Returns when the handler does (or there is none); the caller then exits with
        128 + signum.

        SLURM carries out a requeue by ending the job's step with SIGTERM, and on a busy
        controller that can reach ``scontrol`` itself before it has returned: the requeue it
        asked for is under way, so its death by SIGTERM ends the job as the requeue would,
        rather than as a failure that submitit records as the job's result (the sweep's
        driver would then fail a job that goes on)."""
        handler = signal.getsignal(signum)
        if not callable(handler) or handler is signal.default_int_handler:  # Ctrl-C: saved
            return
        try:
            handler(signum, None)
        except subprocess.CalledProcessError as e:
            if e.returncode != -signal.SIGTERM or "requeue" not in e.cmd:
                raise
            log.warning("%s ended by SIGTERM: SLURM ends the step for the requeue", e.cmd)


class Loader(Protocol):
    """An epoch's collated batches, in order, and their number (a DataLoader, or the stream
    of a target's producers: ``data.stream.FeatureStream``)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...

    def __len__(self) -> int: ...


class BatchSource(Protocol):
    """Where the trainer's micro-batches come from (``builder.TrainBatches``)."""

    def train_loader(self, epoch: int, start: int = 0, limit: int | None = None) -> Loader:
        """This rank's batches of ``epoch`` in its seeded order, after ``start`` global ones;
        at most ``limit`` of them (the run needs no more: a stream produces no more)."""
        ...

    def eval_loader(self) -> Loader | None:
        """This rank's held-out batches; None without an eval split."""
        ...

    def producer_records(self) -> list[dict[str, Any]] | None:
        """What each producer of the target's states did (target=vllm); None where the
        states are read or computed here."""
        ...

    def make_batch(self, batch: dict[str, torch.Tensor], train: bool = True) -> AnyBatch:
        """A collated batch (on the device) as the draft's training sees it: EAGLE-3's with
        the teacher computed, DFlash's with its anchors drawn (fixed ones when not ``train``)."""
        ...


@dataclass
class Components:
    """Everything the trainer runs with, built from the config (``builder.build``)."""

    module: TrainingModule  # the draft with its training forward (FSDP-wrapped)
    batches: BatchSource
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    tracker: Tracker
    weights_k: torch.Tensor  # loss weight of each TTT step (block slot)
    max_grad_norm: float  # 0 = no clipping
    max_num_steps: int
    world: World
    output_dir: Path
    config_yaml: str  # the resolved config, saved in every checkpoint
    tau_probe: Callable[[AnyDraft], float] | None = None  # rank 0's real-τ measurement
    checkpoint: Path | None = None  # the checkpoint to resume from
    # every checkpoint's run.json: the run's identity and the changes made on resume
    # (checkpoint.run_record)
    run_record: dict[str, Any] | None = None
    profile: ProfileConfig | None = None  # profile steps of the run (profile.enabled)


def due(step: int, every_n_steps: int) -> bool:
    """Whether something done every N steps (0 = never) is due at ``step``."""
    return every_n_steps > 0 and step % every_n_steps == 0


class Trainer:
    def __init__(self, cfg: TrainerConfig, parts: Components) -> None:
        self.cfg, self.parts = cfg, parts
        self.module, self.batches, self.world = parts.module, parts.batches, parts.world
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.tracker, self.output_dir = parts.tracker, parts.output_dir
        # per-position metrics: one per TTT step (EAGLE-3) or per block slot after the first
        self.num_positions, self.weights_k = parts.module.num_positions, parts.weights_k
        self.max_num_steps, self.device = parts.max_num_steps, parts.world.device
        self.eval_loader = parts.batches.eval_loader()
        self.step, self.epoch = 0, 0
        self.saved_step = 0  # the step of the newest checkpoint (0: none)
        self.resumed_from: Path | None = None
        self.result = TrainResult(step=0)  # what train() returns; a resumed run's goes on
        # global batches of the epoch used before its loader started (resumed runs), and this
        # rank's batches drawn from the loader since
        self.epoch_start, self.batches_into_epoch = 0, 0
        self.tau_probe = parts.tau_probe  # rank 0's, when trainer.eval_tau_every_n_steps is set
        self.profiler: StepProfiler | None = None
        self._replica: AnyDraft | None = None  # rank 0's whole draft for τ, when sharded
        self.stop = StopSignals()
        bf16 = cfg.compute_dtype.choice(self.device).dtype == torch.bfloat16
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16)
        if parts.checkpoint is not None:
            self.resume(parts.checkpoint)
        if parts.profile is not None:  # counts from the step the run starts at
            self.profiler = StepProfiler(
                parts.profile, self.output_dir / "profile", self.world.rank, self.device, self.step
            )

    def due(self, every_n_steps: int) -> bool:
        """Whether something done every N steps (0 = never) is due at this step."""
        return due(self.step, every_n_steps)

    def micro_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches forever, epoch after epoch, each epoch in its own seeded order; a
        resumed run starts after the batches its epoch had already used."""
        while True:
            left = (self.max_num_steps - self.step) * self.cfg.grad_accum_steps
            loader = self.batches.train_loader(self.epoch, self.epoch_start, left)
            for batch in loader:
                self.batches_into_epoch += 1
                yield {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            self.epoch, self.epoch_start, self.batches_into_epoch = self.epoch + 1, 0, 0

    def progress(self) -> dict[str, int]:
        """Where the run is: step, epoch, and how many of the epoch's global batches (in its
        seeded order, over all data shards) are used -- the same for any number of ranks."""
        shards = self.world.dims.data_shards
        return {
            "step": self.step,
            "epoch": self.epoch,
            "global_batches_into_epoch": self.epoch_start + self.batches_into_epoch * shards,
            "data_shards": shards,
            "max_num_steps": self.max_num_steps,
        }

    def resume(self, checkpoint: Path) -> None:
        """Continue from a checkpoint: weights, optimizer, scheduler, RNG, step and data position."""
        progress = load_checkpoint(
            checkpoint, self.module, self.optimizer, self.scheduler, self.world
        )
        self.step, self.epoch = progress["step"], progress["epoch"]
        self.saved_step = self.step
        self.resumed_from = checkpoint
        # the evaluations before the stop: the summary and the learning curve go on from them
        history = read_history(checkpoint)
        self.result.initial_eval = history.get("initial_eval", {})
        self.result.eval_by_step = history.get("eval_by_step", {})
        self.result.tau_by_step = history.get("tau_by_step", {})
        self.result.final_eval = self.result.eval_by_step.get(self.step, {})
        best = self.checkpoint_dir("best")
        if self.result.tau_by_step and (best / TRAINING_STATE).is_file():
            self.result.best_checkpoint = best
        saved_shards = progress.get("data_shards", 1)
        # (checkpoints of one-process runs before data sharding counted that rank's batches)
        used = progress.get("global_batches_into_epoch", progress.get("batches_into_epoch", 0))
        self.epoch_start, self.batches_into_epoch = used, 0
        if saved_shards != self.world.dims.data_shards:
            log.warning(
                "resuming a run saved with %d data shards on %d: the rest of epoch %d is dealt "
                "to the ranks differently and each step now takes another number of batches, "
                "so the data order (and the loss trace) differs from the uninterrupted run; the "
                "step count and learning-rate schedule are the run's own",
                saved_shards,
                self.world.dims.data_shards,
                self.epoch,
            )
        log.info("resumed from %s at step %d (epoch %d)", checkpoint, self.step, self.epoch)

    def train_step(self, raw: list[dict[str, torch.Tensor]]) -> tuple[StepSums, float, float]:
        """One optimizer step over the micro-batches ``raw``: the step's sums over every rank,
        the gradient norm before clipping, and the lr the step used."""
        batches = [self.batches.make_batch(b) for b in raw]
        counts_k = torch.stack([self.module.count_positions(b) for b in batches]).sum(0)
        scale_k = self.module.loss_scales(self.world.all_reduce_sum(counts_k), self.weights_k)
        sums = StepSums.zeros(self.num_positions)
        self.optimizer.zero_grad(set_to_none=True)
        for index, batch in enumerate(batches):
            set_gradient_sync(self.module, index == len(batches) - 1)
            with self.autocast:
                stats = self.module.stats(batch, scale_k)
            stats.loss.backward()
            sums.add(stats, int(batch.valid_BT[:, : batch.computed_length].sum()))
        params = [p for p in self.module.parameters() if p.requires_grad]
        max_norm = self.parts.max_grad_norm if self.parts.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        lr = float(self.optimizer.param_groups[0]["lr"])  # this step's (the schedule moves on)
        self.optimizer.step()
        self.scheduler.step()
        return sums.summed_over(self.world), grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        assert self.eval_loader is not None
        self.module.eval()
        sums = StepSums.zeros(self.num_positions)
        for raw in self.eval_loader:
            on_device = {k: v.to(self.device) for k, v in raw.items()}
            batch = self.batches.make_batch(on_device, train=False)
            with self.autocast:
                stats = self.module.stats(batch)
            sums.add(stats, int(batch.valid_BT[:, : batch.computed_length].sum()))
        self.module.train()
        return sums.summed_over(self.world).metrics("eval", self.weights_k)

    def checkpoint_dir(self, name: str | None = None) -> Path:
        """Where checkpoint ``name`` is saved (None: this step's)."""
        return self.output_dir / "checkpoints" / (name or f"step_{self.step:08d}")

    def save(self, name: str | None = None) -> Path:
        path = self.checkpoint_dir(name)
        saved = save_checkpoint(
            path,
            self.module,
            self.optimizer,
            self.scheduler,
            self.progress(),
            self.parts.config_yaml,
            self.world,
            history={
                "initial_eval": self.result.initial_eval,
                "eval_by_step": self.result.eval_by_step,
                "tau_by_step": self.result.tau_by_step,
            },
            record=self.parts.run_record,
        )
        if name is not None:  # a named checkpoint (best): not one of the steps
            return saved
        self.saved_step = self.step
        if self.cfg.keep_last_n is not None and self.world.is_main:
            steps = sorted(path.parent.glob("step_*"))
            for old in steps[: -self.cfg.keep_last_n]:
                shutil.rmtree(old, ignore_errors=True)  # a leftover is harmless, a crash is not
        return saved

    def _saved_before(self, stopped: InputsStopped) -> InputsStopped:
        """``stopped``, once the steps trained since the newest checkpoint are saved (in a
        one-process run: ranks would have to save together, and theirs may not stop alike)."""
        if self.world.size > 1 or self.step == self.saved_step:
            return stopped
        path = self.save()
        log.info("step %d saved before stopping: %s", self.step, path)
        return type(stopped)(f"{stopped} (step {self.step} was saved first: {path})")

    def whole_draft(self) -> AnyDraft | None:
        """The draft with whole parameters on rank 0 (None elsewhere): the module's own draft
        in a one-process run, else a replica refreshed from the shards (a collective)."""
        if not self.world.distributed:
            return self.module.draft
        tensors = full_draft_state(self.module)
        if not self.world.is_main:
            return None
        if self._replica is None:
            self._replica = self.module.draft.replica()
        self._replica.load_state_dict(tensors)
        return self._replica

    def _eval_and_log(self, result: TrainResult) -> dict[str, float]:
        metrics = self.evaluate()
        self.tracker.log_metrics(metrics, step=self.step)
        result.final_eval = result.eval_by_step[self.step] = metrics
        return metrics

    def _measure_tau(self, result: TrainResult) -> None:
        """Real τ of the current draft; a new best is saved as checkpoints/best."""
        probe, draft = self.tau_probe, self.whole_draft()  # (rank 0 has them)
        measured = self.world.on_main(
            lambda: probe(draft) if probe is not None and draft is not None else 0.0,
            RuntimeError("rank 0 failed measuring τ (see its log)"),
        )
        tau = self.world.broadcast_float(measured or 0.0)
        best = max(result.tau_by_step.values(), default=float("-inf"))
        result.tau_by_step[self.step] = tau
        metrics = {"eval/tau": tau}
        if tau > best:
            result.best_checkpoint = self.save("best")
            metrics["eval/best_tau_step"] = float(self.step)
        self.tracker.log_metrics(metrics, step=self.step)

    def _preempted(self, result: TrainResult) -> TrainResult:
        """After a stop signal (StopSignals): the step is finished; save it and report it."""
        if not self.due(self.cfg.save_every_n_steps):
            result.checkpoint = self.save()
        signum = self.stop.signal
        assert signum is not None
        result.step, result.preempted_by = self.step, signum
        # the entry point says what to run to go on (the run's directory is part of it)
        log.warning(
            "stopped by %s after step %d of %d; checkpoint %s",
            signal.Signals(signum).name,
            self.step,
            self.max_num_steps,
            result.checkpoint,
        )
        return result

    def _already_complete(self) -> TrainResult:
        """Resumed at (or past) the last step: the run ended before; nothing is redone."""
        best = self.checkpoint_dir("best")
        log.info(
            "the run is already complete (step %d of %d); its last checkpoint is %s",
            self.step,
            self.max_num_steps,
            self.resumed_from,
        )
        return TrainResult(
            step=self.step,
            checkpoint=self.resumed_from,
            best_checkpoint=best if (best / TRAINING_STATE).is_file() else None,
            already_complete=True,
        )

    def train(self) -> TrainResult:
        with self.stop:
            try:
                return self._train()
            finally:
                if self.profiler is not None:
                    self.profiler.stop()

    def _train(self) -> TrainResult:
        cfg, result = self.cfg, self.result
        result.step = self.step
        if self.resumed_from is not None and self.step >= self.max_num_steps:
            return self._already_complete()
        self.module.train()
        if self.eval_loader is not None and cfg.eval_at_start and self.step == 0:
            result.initial_eval = self._eval_and_log(result)
        batches = self.micro_batches()
        window, window_start = StepSums.zeros(self.num_positions), time.perf_counter()
        # a bar on a terminal only; in a SLURM log or a file the metric lines say how far it is
        bar = Progress(
            self.max_num_steps, "train", "step", initial=self.step,
            shown=cfg.progress_bar and self.world.is_main, lines=False,
        )  # fmt: skip
        while self.step < self.max_num_steps:
            try:
                micro = [next(batches) for _ in range(cfg.grad_accum_steps)]
            except InputsStopped as stopped:
                bar.close()
                raise self._saved_before(stopped) from None
            sums, grad_norm, lr = self.train_step(micro)
            self.step += 1
            if self.profiler is not None:
                self.profiler.step()
            window.add(sums, sums.num_tokens)
            step_metrics = sums.metrics("train", self.weights_k)
            result.train_losses.append(step_metrics["train/loss"])
            tokens_per_s = window.num_tokens / max(time.perf_counter() - window_start, 1e-9)
            bar.update(1)
            bar.set_postfix(
                loss=f"{step_metrics['train/loss']:.3f}",
                acc_0=f"{step_metrics['train/acc_0']:.3f}",
                tok_s=f"{tokens_per_s:.0f}",
            )
            last_step = self.step == self.max_num_steps  # saved below, after the final eval
            if self.due(cfg.log_every_n_steps) or last_step:
                metrics = window.metrics("train", self.weights_k)
                metrics.update(
                    {
                        "train/lr": lr,  # the lr this step used
                        "train/grad_norm": grad_norm,
                        "train/tokens_per_s": tokens_per_s,
                        "train/peak_mem_mib": peak_memory_mib(self.device),
                        "train/epoch": float(self.epoch),
                    }
                )
                self.tracker.log_metrics(metrics, step=self.step)
                window, window_start = StepSums.zeros(self.num_positions), time.perf_counter()
            if self.eval_loader is not None and self.due(cfg.eval_every_n_steps):
                self._eval_and_log(result)
            if self.due(cfg.save_every_n_steps) and not last_step:
                result.checkpoint = self.save()
            if cfg.eval_tau_every_n_steps and (self.due(cfg.eval_tau_every_n_steps) or last_step):
                self._measure_tau(result)
            # all ranks stop together; at the last step the run ends normally (eval, save)
            if not last_step and self.world.any(self.stop.signal is not None):
                self.stop.signal = self.stop.signal or signal.SIGTERM
                bar.close()
                return self._preempted(result)
        bar.close()
        if self.eval_loader is not None and not self.due(cfg.eval_every_n_steps):
            self._eval_and_log(result)
        result.checkpoint = self.save()
        result.step = self.step
        return result
