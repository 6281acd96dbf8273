"""The Trainer: one loop over composable parts (data, model, optimizer, precision, communicator).

The clocks (``state.TrainingProgress``): MLPerf's starts once initialisation is over, before any data is
touched (its run_start), never pauses and includes evaluation; it is split into start-up, training
steps, evaluation and the rest, and initialisation is timed phase by phase (``tracking.Phases``). All
continue across resumes. Every decision that could differ between ranks (stop, skip a step) is taken from
all-reduced values. What a checkpoint holds is the ``TrainState`` (state.py); what a run reports at
its end, ``tracking.run_summary``; its MLPerf-format log (``<run_dir>/mlperf.log``), ``mlperf_log.MlperfLog``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from gradientflow_repro import faults, logs
from gradientflow_repro.checkpoint import CheckpointClock
from gradientflow_repro.comm import build_communicator
from gradientflow_repro.data import batch_dtype, build_data
from gradientflow_repro.distributed import World, agree_max, all_reduce_scalars, mark_progress, ranks_that_differ
from gradientflow_repro.mlperf_log import MlperfLog
from gradientflow_repro.models import build_model
from gradientflow_repro.optim import build_optimizer, build_schedule, set_lr
from gradientflow_repro.precise_bn import PreciseBatchNorm
from gradientflow_repro.precision import Precision
from gradientflow_repro.preemption import StopRequests
from gradientflow_repro.run_dir import write_atomically, write_text_atomically
from gradientflow_repro.state import LocalBuffers, ModelName, ModelWeights, TrainingProgress, TrainState, rng_parts
from gradientflow_repro.tracking import Phases, Tracker, duration, run_summary

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on safely (the message says why, at which step, and what was saved)."""


class Trainer:
    def __init__(self, cfg: DictConfig, world: World, device: torch.device, phases: Optional[Phases] = None,
                 early_signal: int = 0) -> None:
        """``phases``: start-up so far (imports, process group); the Trainer adds its own, then
        starts MLPerf's clock just before the data is first touched. ``early_signal``: a stop
        signal that came before the Trainer listened (``train.EARLY_STOP_SIGNALS``)."""
        phases = phases or Phases()
        self.cfg, self.world, self.device = cfg, world, device
        self.run_dir = Path(cfg.run_dir)
        self.run_name = cfg.logger.name or cfg.comm.strategy  # wandb run and progress-line prefix
        # every line from here on names the run; information from rank 0 only (logs.configure)
        logs.set_prefix(f"{cfg.experiment}/{self.run_name}", world.rank)
        self.stop = StopRequests(received=early_signal)  # before the slow start-up
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        # data.channels_last: the batches come NHWC, so the weights go channels_last too (cuDNN's
        # tensor-core convolutions are NHWC; mixing layouts would transpose in every layer)
        layout = torch.channels_last if cfg.data.channels_last else torch.preserve_format
        self.model = build_model(cfg.model.name, cfg.data.num_classes, cfg.data.image_size, cfg.model.width,
                                 cfg.model.dropout, cfg.model.bn_momentum).to(device, memory_format=layout)
        self.optimizer = build_optimizer(self.model, cfg.optim, cfg.global_batch_size)
        phases.done("model")
        self.comm = build_communicator(OmegaConf.to_container(cfg.comm), device,
                                       world.local_world_size, world.local_rank, cfg.optim.warmup_epochs)
        self.train_model = self.comm.attach(self.model, self.optimizer)
        log.info(f"communication: {cfg.comm.strategy}, {self.comm.summing}"
                 + (f"; {self.comm.schedule}" if self.comm.schedule else ""))
        self.precision = Precision(cfg.precision, device)
        if self.precision.emulated_bf16 and world.is_main:  # the same on every rank: said once
            log.warning("precision=bf16 on a CPU without native bf16 (no AVX-512 BF16 or AMX): oneDNN "
                        "emulates it, so each step takes many times its fp32 time; precision=fp32 is faster here")
        self.criterion = nn.CrossEntropyLoss()
        self.model.train()
        self.progress = TrainingProgress()
        self.buffers = LocalBuffers(self.model, world.world_size)
        self.precise_bn = PreciseBatchNorm(cfg.precise_bn_batches)
        phases.done("communicator")
        self.tracker = Tracker(self.run_dir, cfg.logger, enabled=world.is_main, name=self.run_name,
                               group=cfg.logger.group or cfg.experiment,
                               config=OmegaConf.to_container(cfg, resolve=True))
        described = f"{cfg.model.name}, width {cfg.model.width}, {cfg.data.num_classes} classes"
        self.state = TrainState(
            shared={"model_name": ModelName(cfg.model.name), "model": ModelWeights(self.model, described),
                    "optimizer": self.optimizer, "precision": self.precision, "wandb_id": self.tracker,
                    "progress": self.progress},
            per_rank={"buffers": self.buffers, "comm": self.comm, **rng_parts(device),
                      # only when on: checkpoints without it keep the layout they always had
                      **({"precise_bn": self.precise_bn} if cfg.precise_bn_batches else {})},
            rank=world.rank, world_size=world.world_size, device=device)
        self._nonfinite_streak = 0
        self.checkpoint_clock = CheckpointClock(cfg.checkpoint.every_minutes)  # agreed in train_step
        self._checkpoint_due = False
        torch.manual_seed(cfg.seed + 1 + world.rank)  # dropout differs between ranks, as on a cluster
        resumed = self.state.resume(self.run_dir, cfg.resume)
        if resumed:
            log.info(f"resumed from {resumed} at step {self.progress.step}")
            if self.state.regrouped:  # another number of ranks: how the per-rank state was mapped
                log.info(self.state.regrouped)
            if self.state.set_aside:  # an abandoned lineage, or checkpoints the resume skipped
                log.info(self.state.set_aside)
        phases.done("resume")
        # after the resume: a resumed run continues its wandb run, and its metrics.jsonl is cut back
        # to the checkpoint it resumed from (tracking.Tracker: one lineage)
        self.tracker.start(self.progress.step)
        if world.is_main:  # the composed configuration, as this run used it
            write_text_atomically(self.run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        phases.done("tracker")
        # MLPerf's run_start: initialisation is over, no data has been touched
        self.progress.start_clock(init_s=phases.total_s)
        self.mlperf = MlperfLog(self.run_dir, enabled=world.is_main, epochs=cfg.epochs,
                                eval_every_epochs=cfg.eval_every_epochs)  # <run_dir>/mlperf.log
        self.mlperf.run_start(cfg, world.world_size, device, init_s=phases.total_s)
        self.init_phases = phases
        try:
            # on a GPU, fp16 runs take fp16 images from DALI (half the copies; autocast would cast
            # them anyway); on a CPU the images stay fp32, as every CPU result was measured
            images = batch_dtype(cfg.precision.dtype) if device.type == "cuda" else torch.float32
            self.data = build_data(cfg.data, global_batch=cfg.global_batch_size, rank=world.rank,
                                   world_size=world.world_size, device=device, seed=cfg.seed, output_dtype=images)
        except BaseException:  # bad images: the run has started (tracker, MLPerf log) and ends aborted
            self.abandon()
            raise
        self.schedule = build_schedule(cfg.optim, cfg.global_batch_size, self.data.steps_per_epoch,
                                       cfg.epochs)
        self.total_steps = min(cfg.epochs * self.data.steps_per_epoch, cfg.max_steps or float("inf"))
        self.mlperf.hyperparameters(cfg, self.data, self.schedule, self.optimizer)
        self.data_s = time.perf_counter() - self.progress.clock_start  # listing and checking the files
        self._last_log = (self.progress.step, self.progress.train_s)  # for rates between progress lines
        self._last_loss_lr: Optional[tuple[torch.Tensor, float]] = None
        # how much longer the slowest rank's forward and backward took than this rank's, since the
        # last progress record (train_step); on a GPU the host has only queued them when backward
        # returns (its time says nothing of the device's), so only CPU runs time them
        self._behind_s, self._times_ranks = 0.0, device.type == "cpu"

    # ---------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        p, steps_per_epoch = self.progress, self.data.steps_per_epoch
        self._log({"kind": "start", "resumed_from_step": p.step, "world_size": self.world.world_size,
                   "init_phases_s": self.init_phases.seconds, "data_s": self.data_s})
        if p.eval_pending:  # the stop that wrote the checkpoint came before this evaluation
            self.evaluate()
        while p.step < self.total_steps and not p.reached_at and not self.stop.agreed_signal:
            epoch = p.step // steps_per_epoch
            self.mlperf.epoch_start(epoch)
            for images, labels in self.data.train_batches(epoch, skip=p.step % steps_per_epoch):
                self.train_step(images, labels)
                if p.step >= self.total_steps or self.stop.agreed_signal:
                    break
                if self._checkpoint_due:  # checkpoint.every_minutes, agreed by every rank in the step
                    self.save()
                    if self.stop.agreed(self.device):  # a signal during the save stops here
                        break
            if p.step % steps_per_epoch == 0:  # a whole epoch ended (not a max_steps cut)
                done_epochs = p.step // steps_per_epoch
                self.mlperf.epoch_stop(epoch)
                due = done_epochs % self.cfg.eval_every_epochs == 0 or done_epochs == self.cfg.epochs
                if self.stop.agreed_signal:  # the stop's checkpoint first: the evaluation waits for
                    p.eval_pending = due  # the resumed run, instead of spending the preemption window
                    break
                if due:
                    self.evaluate()
                if self.cfg.checkpoint.every_epochs and done_epochs % self.cfg.checkpoint.every_epochs == 0:
                    self.save()
                    self.stop.agreed(self.device)  # a signal that came during the save stops here,
                    # not one step later with a second full checkpoint
        self.mlperf.run_stop(reached_target=bool(p.reached_at))  # MLPerf's clock stops here
        self.save()
        mark_progress(None)  # the last collective is behind us: what follows is rank 0's own work
        self.stop.ignore_from_now()
        self.comm.close()
        if self.stop.agreed_signal:
            log.info(f"stopped by {self.stop.name} after step {p.step}: checkpoint saved"
                     + (", asking for a requeue" if self.stop.requeue else ""))
        return self._finish()

    def train_step(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        started, step = time.perf_counter(), self.progress.step
        mark_progress(f"step {step}")
        self.precise_bn.remember(images, step, self.data.steps_per_epoch)
        lr = self.schedule(step)
        set_lr(self.optimizer, lr)
        faults.inject("forward", step)
        self.comm.begin_step(step / self.data.steps_per_epoch, self.precision.loss_scale_tensor())
        with self.precision.autocast():
            loss = faults.inject("loss", step, self.criterion(self.train_model(images), labels))
        self.precision.backward(loss)
        computed = time.perf_counter() - started if self._times_ranks else 0.0  # forward and backward
        faults.inject("comm", step)
        self.comm.synchronize()
        # the step's one read-back: did any rank overflow, did any rank get a stop signal, and how
        # long the slowest rank's forward and backward took (ranks sharing cores finish at different
        # times, and the first collective after backward waits for the last: logged, not acted on)
        overflow, signal, slowest, due = agree_max([self.precision.nonfinite(self.optimizer), self.stop.received,
                                                    computed, self.checkpoint_clock.due()], self.device)
        self._checkpoint_due = due > 0
        self._behind_s += slowest - computed
        applied = self.precision.apply(self.optimizer, overflow > 0)  # skipped on every rank, or none
        self.stop.agreed_signal = int(signal)
        self.comm.end_step(applied=applied)
        self.optimizer.zero_grad(set_to_none=True)
        faults.inject("params", step, next(self.model.parameters()))
        self.progress.stepped(time.perf_counter() - started)
        self._last_loss_lr = (loss, lr)  # for a progress record at a checkpoint between log steps
        self._guard(applied, loss)
        if self.progress.step % self.cfg.logger.log_every == 0 or self.progress.step == self.total_steps:
            self._log_step(loss, lr)

    def _guard(self, applied: bool, loss: torch.Tensor) -> None:
        """Stop rather than train on: non-finite values (all precisions but fp16 at once; fp16 after
        ``max_nonfinite_steps`` skipped steps in a row, as loss scaling recovers from single ones),
        or parameters that differ between ranks (checked every ``consistency_every_steps``)."""
        p = self.progress
        self._nonfinite_streak = 0 if applied else self._nonfinite_streak + 1
        limit = self.cfg.max_nonfinite_steps if self.precision.scaler else 1
        if self._nonfinite_streak >= limit:
            self.save()  # the parameters are still the last good ones: skipped steps change nothing
            raise TrainingError(
                f"step {p.step}: gradients were non-finite on some rank for {self._nonfinite_streak} "
                f"step(s) in a row ({self.cfg.precision.dtype}, loss {loss.item():.4g} on rank "
                f"{self.world.rank}); no update used them. Stopped with a checkpoint of the last good "
                f"state in {self.run_dir / 'checkpoints'}; try a lower optim.base_lr or precision=fp32")
        every = self.cfg.consistency_every_steps
        if every and self.world.world_size > 1 and p.step % every == 0:
            differ = ranks_that_differ(self.model.parameters(), self.device)
            if differ:
                raise TrainingError(
                    f"step {p.step}: parameters differ between ranks: rank(s) {differ} disagree with "
                    f"rank 0 (parameter checksums). Ranks must apply identical updates; stopped before "
                    f"the divergence spreads. The last checkpoint before it is in "
                    f"{self.run_dir / 'checkpoints'}")

    @torch.no_grad()
    def evaluate(self) -> float:
        p, started = self.progress, time.perf_counter()
        mark_progress(f"evaluation after step {p.step}")
        self.mlperf.eval_start(p.step / self.data.steps_per_epoch)
        correct, total = torch.zeros((), dtype=torch.int64, device=self.device), 0
        # statistics of the weights evaluated (if configured), then the consensus model's; after
        # both, this rank's own running statistics again for training
        with self.precise_bn.recomputed(self.model, self.buffers, self.precision.autocast), \
                self.buffers.averaged():
            self.model.eval()
            for images, labels in self.data.val_batches():
                with self.precision.autocast():
                    logits = self.model(images)
                correct += (logits.argmax(1) == labels).sum()  # counted on the device, read once
                total += labels.numel()
        self.model.train()
        # past this rank's data: a rank stuck in its own data loop is the one behind (its mark is older)
        mark_progress(f"evaluation after step {p.step}: counting")
        correct, total = all_reduce_scalars([correct, total], self.device)
        if int(total) != self.data.num_val:
            raise RuntimeError(f"evaluation saw {int(total)} images, the validation set has "
                               f"{self.data.num_val}: sharding is broken")
        p.evaluated(time.perf_counter() - started)
        p.eval_pending = False
        top1, target = 100.0 * correct / total, self.cfg.target_top1
        p.last_top1, p.best_top1 = top1, max(top1, p.best_top1 or 0.0)
        self.mlperf.eval_stop(p.step / self.data.steps_per_epoch, accuracy=top1 / 100)
        if target is not None and top1 >= target and not p.reached_at:
            p.reached_at = {"step": p.step, **p.clocks()}
        self._log({"kind": "eval", "top1": top1, "target_top1": target,
                   "epoch": p.step / self.data.steps_per_epoch})
        log.info(f"eval  step {p.step} epoch {p.step / self.data.steps_per_epoch:.1f}: "
                 f"top-1 {top1:.2f}% (target {target}) at {p.mlperf_s:.1f}s")
        return top1

    def abandon(self) -> None:
        """The run ends in an error: its MLPerf log says aborted and its tracker closes (idempotent;
        nothing after a normal finish)."""
        self.mlperf.run_stop(reached_target=False)
        self.tracker.abandon()

    def save(self) -> None:
        if self.progress.step > self._last_log[0] and self._last_loss_lr:  # steps since the last progress
            self._log_step(*self._last_loss_lr)  # record: log them, so the totals saved and summed are whole
        self.state.save(self.run_dir, self.progress.step, keep=self.cfg.checkpoint.keep)
        self.checkpoint_clock.restart()
        self.tracker.checkpointed(self.progress.step)  # where a resume from it cuts metrics.jsonl

    # ---------------------------------------------------------------- reporting
    def _log_step(self, loss: torch.Tensor, lr: float) -> None:
        p, comm = self.progress, self.comm.stats.take()
        last_step, last_train_s = self._last_log
        steps, interval = max(1, p.step - last_step), max(1e-9, p.train_s - last_train_s)
        self._last_log = (p.step, p.train_s)
        for key in p.comm_totals:
            p.comm_totals[key] += comm[key]
        images_per_s = steps * self.cfg.global_batch_size / interval
        record = {"kind": "train", "loss": loss.item(), "lr": lr, "images_per_s": images_per_s,
                  "step_s": interval / steps, "bytes_per_step": comm["bytes"] / steps,
                  "collectives_per_step": comm["collectives"] / steps,
                  "sync_wait_s_per_step": comm["wait_s"] / steps, "density": self.comm.density_now,
                  **({"behind_slowest_s_per_step": self._behind_s / steps} if self._times_ranks else {}),
                  "loss_scale": self.precision.loss_scale, "skipped_steps": self.precision.skipped_steps,
                  "epoch": p.step / self.data.steps_per_epoch, **self.comm.sparsity_stats()}
        self._behind_s = 0.0
        self._log(record)
        eta = (self.total_steps - p.step) * interval / steps
        top1 = f"{p.last_top1:.2f}%" if p.last_top1 is not None else "-"
        log.info(f"step {p.step}/{self.total_steps} epoch {record['epoch']:.2f}/{self.cfg.epochs} "
                 f"loss {record['loss']:.4f} top-1 {top1} {images_per_s:.0f} img/s lr {lr:.4g} "
                 f"eta {duration(eta)}")

    def _log(self, record: dict) -> None:
        p = self.progress
        self.tracker.log({**record, "step": p.step, **p.clocks()})

    def _finish(self) -> dict[str, Any]:
        summary = run_summary(self.cfg, self.progress, world=self.world, device=self.device,
                              steps_per_epoch=self.data.steps_per_epoch,
                              skipped_steps=self.precision.skipped_steps, stopped_by=self.stop.name,
                              exit_code=self.stop.exit_code, run_id=self.tracker.run_id)
        if self.cfg.save_final_params:
            params = {n: t.detach().cpu() for n, t in self.model.state_dict().items()}
            write_atomically(self.run_dir / f"final_params_rank{self.world.rank}.pt",
                             lambda handle: torch.save(params, handle))
        self.tracker.finish(summary)
        if reached := self.progress.reached_at:
            log.info(f"target {self.cfg.target_top1}% reached at step {reached['step']}: "
                     f"{reached['mlperf_s']:.1f}s (MLPerf clock), {reached['train_s']:.1f}s (training)")
        return summary
