"""``CSCCommunicator``: coarse-grained sparse communication as a ``Communicator`` of the trainer.

The lazy-allreduce pool (``lazy.py``) gathers gradients into parts during backward; this subclass
sends each part sparsely (``state.BucketState``), runs the density schedule, hands the optimizer's
pre-momentum settings to momentum correction and back, and saves and restores its state.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.checkpoint import CheckpointError
from gradientflow_repro.checks import field_problems
from gradientflow_repro.comm.base import GradScale, SumFn
from gradientflow_repro.comm.csc.momentum import (
    TAKEN,
    LocalStep,
    give_back,
    merged_settings,
    take_settings,
    velocity_from_optimizer,
)
from gradientflow_repro.comm.csc.selection import density_at
from gradientflow_repro.comm.csc.state import BucketState, rank_rules
from gradientflow_repro.comm.csc.trust import adapts
from gradientflow_repro.comm.lazy import Bucket, LazyAllreduce
from gradientflow_repro.comm.pool import csc_parts
from gradientflow_repro.comm.recursive_doubling import small_sum


def check_settings(**values: Any) -> None:
    """Refuse ``comm.*`` values (keyword: the ``CSCKeys`` field) that their declarations in
    ``csc.CSCKeys`` refuse, naming the key, as ``plan.resolve`` does. The rules live on the
    declarations only (``checks.field_problems``): a configuration from the factory was checked there
    already, and a ``CSCCommunicator`` built directly gets the same rules, not a second copy."""
    from gradientflow_repro.comm.csc import CSCKeys

    for key, value, allowed in field_problems(CSCKeys, CSCKeys(**values), "comm."):
        raise ValueError(f"config key '{key}' = {value!r}: {allowed}")


class CSCCommunicator(LazyAllreduce):
    """Coarse-grained sparse communication over the lazy-allreduce pool (the algorithm:
    ``csc/__init__.py``). Lays the pool out in CSC's parts (``layout``), keeps one ``BucketState``
    per part, and, while the density schedule is below 1, sends each part by
    ``BucketState.sparsify`` instead of densely; under momentum correction it takes momentum, weight
    decay and Lars's adaptation from the optimizer for the sparse phases (``momentum.py``). Its
    ``state_dict`` holds each part's state by part index, with the keys of earlier versions."""

    def __init__(self, device: torch.device, sum_fn: SumFn, bucket_bytes: int, overlap: bool,
                 chunk_size: int, density: float, warmup_epochs: float,
                 momentum_correction: bool = True, momentum_masking: bool = True,
                 density_ramp_epochs: int = 0, release_cap: float = 0.0,
                 trust_noise_correction: bool = True, masking_min_wait: float = 0.0,
                 rank_by: str = "rescaled", weight_decay_in: str = "velocity") -> None:
        check_settings(chunk_size=chunk_size, density=density, density_ramp_epochs=density_ramp_epochs,
                       release_cap=release_cap, momentum_correction=momentum_correction,
                       momentum_masking=momentum_masking, trust_noise_correction=trust_noise_correction,
                       masking_min_wait=masking_min_wait, rank_by=rank_by, weight_decay_in=weight_decay_in)
        super().__init__(device, sum_fn, bucket_bytes, overlap)
        self.chunk_size, self.density, self.warmup_epochs = chunk_size, density, warmup_epochs
        self.density_ramp_epochs = density_ramp_epochs
        self.density_now = 1.0
        self.momentum_correction, self.momentum_masking = momentum_correction, momentum_masking
        self.trust_noise_correction = trust_noise_correction
        self.masking_min_wait, self.rank_by, self.weight_decay_in = masking_min_wait, rank_by, weight_decay_in
        self._chunk_entry: list[torch.Tensor] = []  # per part: the bucket entry each chunk starts in
        self._layer_names: list[list[str]] = []  # per part: each entry's parameter name
        self.release_cap = release_cap
        self.norm_sum = small_sum()  # the norms (and the fp16 peak): a small message, log2(N) steps
        self.sparse_now = False
        self.grad_scale: GradScale = None
        self.parts: list[BucketState] = []  # one per pool part, in layout order
        self.local_step: Optional[LocalStep] = None  # the optimizer's pre-momentum step, under momentum correction
        # the optimizer groups' own values of the settings CSC has taken over (sparse phases), or None
        self._taken: Optional[list[dict]] = None
        self._settings: list[dict] = []  # this step's optimizer settings, those taken over included

    def layout(self, params: list[nn.Parameter]) -> list[Bucket]:
        """The pool's parts (``pool.csc_parts``): each holds its multi-dimensional gradients first,
        padded to whole chunks (so that section is a [chunks, chunk_size] matrix for free), then its
        one-dimensional ones, the dense tail sent with the chosen chunks."""
        buckets = []
        for part in csc_parts([p.numel() for p in params], [p.ndim <= 1 for p in params], self.bucket_bytes,
                              self.chunk_size):
            members = [params[i] for i in (*part.sparse, *part.dense)]
            starts = ([sum(params[j].numel() for j in part.sparse[:k]) for k in range(len(part.sparse))]
                      + [part.sparse_elements + sum(params[j].numel() for j in part.dense[:k])
                         for k in range(len(part.dense))])
            buckets.append(self.make_bucket(members, part.elements, starts, part.sparse_elements))
        return buckets

    def _decays_locally(self, step: Optional[LocalStep]) -> bool:
        """Whether weight decay is kept out of the sent velocity (``comm.weight_decay_in=local``): only
        where momentum correction has taken it from the optimizer."""
        return self.weight_decay_in == "local" and step is not None

    def chunks(self, bucket: Bucket) -> torch.Tensor:
        """The part's sparse section as a [chunks, chunk_size] matrix (a view)."""
        return bucket.flat[:bucket.sparse_elements].view(-1, self.chunk_size)

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        super().attach(model, optimizer)
        if self.momentum_correction and optimizer is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            if self.weight_decay_in == "local" and world > 1 and any(adapts(g) for g in optimizer.param_groups):
                # each rank's trust ratio comes from its own gradient, so a decay rescaled by it would
                # differ between ranks and, never summed, so would the weights
                raise ValueError("config key 'comm.weight_decay_in' = 'local': under LARS each rank would rescale "
                                 "the weight decay by its own trust ratio and the ranks' weights would drift "
                                 "apart; use comm.weight_decay_in=velocity, or SGD")
            self.local_step = LocalStep(optimizer, self.buckets, world, self.trust_noise_correction)
        step = self.local_step
        self.parts = [BucketState.zeros(bucket.sparse_elements // self.chunk_size, self.chunk_size,
                                        bucket.flat.device,
                                        velocity_elements=bucket.flat.numel() if self.momentum_correction else 0,
                                        noise_layers=step.noise_layers(bucket.index) if step else 0,
                                        decay_elements=bucket.flat.numel() if self._decays_locally(step) else 0)
                      for bucket in self.buckets]
        names = {param: name for name, param in model.named_parameters()}
        self._layer_names = [[names.get(param, "?") for param in bucket.params] for bucket in self.buckets]
        self._chunk_entry = [self._entry_of_chunks(bucket) for bucket in self.buckets]
        return model

    def _entry_of_chunks(self, bucket: Bucket) -> torch.Tensor:
        """For each chunk of the part's sparse section, the index (in ``bucket.params``) of the
        parameter its first element belongs to."""
        chunks = bucket.sparse_elements // self.chunk_size
        starts = torch.tensor(bucket.offsets, dtype=torch.long)
        first = torch.arange(chunks, dtype=torch.long) * self.chunk_size
        return (torch.searchsorted(starts, first, right=True) - 1).to(bucket.flat.device)

    # per-part state by part index, as tests, gpu_check and checkpoints see it
    @property
    def residual(self) -> dict[int, torch.Tensor]:
        return {i: part.residual for i, part in enumerate(self.parts) if part.residual is not None}

    @property
    def velocity(self) -> dict[int, torch.Tensor]:
        return {i: part.velocity for i, part in enumerate(self.parts) if part.velocity is not None}

    @property
    def last_selection(self) -> dict[int, torch.Tensor]:
        """Part index -> the chunks it last sent (for tests)."""
        return {i: part.last_selection for i, part in enumerate(self.parts) if part.last_selection is not None}

    @property
    def uses_velocity(self) -> bool:
        return self.momentum_correction and self.sparse_now

    def density_at(self, epoch: float) -> float:
        """The fraction of chunks sent in ``epoch``: 1 during the dense warm-up, then the ramp
        (``selection.density_at``)."""
        return density_at(epoch, self.density, self.warmup_epochs, self.density_ramp_epochs)

    def begin_step(self, epoch: float, grad_scale: GradScale = None) -> None:
        # a tensor stays a tensor: comparing it with 1 on the host would wait for the GPU
        self.grad_scale = None if isinstance(grad_scale, (int, float)) and grad_scale == 1 else grad_scale
        self.density_now = self.density_at(epoch)
        self.sparse_now = self.density_now < 1
        self._hand_settings_to_optimizer(not self.uses_velocity)
        if self.optimizer is not None:  # read by the communication thread: built once per step
            self._settings = self.optimizer_settings()

    TAKEN = TAKEN  # what CSC takes from each optimizer group for a sparse phase (``momentum.TAKEN``)

    def _hand_settings_to_optimizer(self, optimizer_owns: bool) -> None:
        """Take momentum, weight decay and Lars's adaptation (``TAKEN``) from the optimizer's groups
        for a sparse phase, or give them back for a dense one (its momentum then restarts: the
        velocities are per rank). Taking is per setting and idempotent, so a state saved by an
        older version (momentum only) completes itself (``momentum.take_settings``)."""
        if self.optimizer is None or not self.momentum_correction:
            return
        groups = self.optimizer.param_groups
        if optimizer_owns:
            if self._taken is not None:
                give_back(groups, self._taken)
                for state in self.optimizer.state.values():
                    state.pop("momentum_buffer", None)
                self._taken = None
            return
        if self._taken is None:
            self._taken = [{} for _ in groups]
            velocity_from_optimizer(self.optimizer, self.buckets, self.parts)
        take_settings(groups, self._taken)

    def optimizer_settings(self) -> list[dict]:
        """Each optimizer group's own settings, those CSC has taken over included."""
        return merged_settings(self.optimizer.param_groups, self._taken)

    def momentum(self) -> float:
        """The momentum of the velocity: the optimizer's own (its first group's)."""
        return self._settings[0].get("momentum", 0.0) if self._settings else 0.0

    def reduce_bucket(self, bucket: Bucket) -> None:
        if not self.sparse_now:
            super().reduce_bucket(bucket)
            return
        part, flat = self.parts[bucket.index], bucket.flat
        if self.grad_scale is not None:
            flat.div_(self.grad_scale)  # in place: the pool part is overwritten below anyway
        sketch = None  # the trust ratio's noise sketch, summed with the chunk norms
        decay = None  # this rank's weight decay velocity under comm.weight_decay_in=local
        if self.uses_velocity and self.local_step is not None:
            decay_step = part.decay_scratch if part.decay is not None else None
            sketch = self.local_step.apply_(bucket, flat, self._settings, part, decay=decay_step)
            if decay_step is not None:
                decay = part.add_decay(decay_step, self.momentum())
        gradient = part.add_momentum(flat, self.momentum()) if self.uses_velocity else flat
        if part.residual is None:  # a part of one-dimensional tensors only: sent densely
            if gradient is not flat:
                flat.copy_(gradient)
        else:
            # no overflow guard: a non-finite chunk has the largest norm, so it is sent and reaches
            # every rank, which then skip the step; end_step(False) discards what it staged
            tail = flat[bucket.sparse_elements:]
            if gradient is not flat:
                tail.copy_(gradient[bucket.sparse_elements:])
            sent = part.sparsify(gradient[:bucket.sparse_elements].view(-1, self.chunk_size), self.density_now,
                                 self.sum_fn, self.norm_sum, self.stats, mask_after=self._mask_after(),
                                 dense=tail, release_cap=self.release_cap, extra=sketch,
                                 rank_weights=self._rank_weights(bucket))
            if sketch is not None:
                self.local_step.noise.observe(bucket, part, sent.extra)
            self.chunks(bucket).zero_().index_copy_(0, sent.chosen, sent.summed)
        if decay is not None and part.residual is not None:
            flat.add_(decay, alpha=self.world_size)  # the sum's share of it: the mean over ranks is this rank's
        if self.grad_scale is not None:
            flat.mul_(self.grad_scale)
        if part.residual is None:
            super().reduce_bucket(bucket)
            if decay is not None:  # after the sum, in the scaled units the flat is in now
                flat.add_(decay if self.grad_scale is None else decay * self.grad_scale, alpha=self.world_size)

    def _mask_after(self) -> Optional[float]:
        """``BucketState.sparsify``'s ``mask_after``: None without masking (or without momentum
        correction, which masking acts on), else ``comm.masking_min_wait``."""
        return self.masking_min_wait if self.momentum_masking and self.uses_velocity else None

    def _rank_weights(self, bucket: Bucket) -> Optional[torch.Tensor]:
        """Under ``comm.rank_by=raw``, each chunk's 1 / trust ratio of its layer this step (the
        velocity's content is in trust-rescaled units, so its norm measures a layer's weights; divided
        by the ratio it measures the gradients that built it up); None otherwise."""
        if self.rank_by != "raw" or not self.uses_velocity or self.local_step is None:
            return None
        ratios = self.local_step.ratios.get(bucket.index)
        return None if ratios is None else ratios.reciprocal()[self._chunk_entry[bucket.index]]

    def sparsity_stats(self) -> dict:
        """Since the last call: ``csc_send_interval_median`` (per layer, named by its parameter, the
        median number of steps between two sends of its chunks; a layer none of whose chunks was sent
        is absent), ``csc_chunks_sent`` (sends counted) and ``csc_masked_momentum_share`` (the share of
        the chunks' velocity, in L1 norm, that momentum factor masking erased). ``{}`` when no sparse
        step ran."""
        intervals: dict[str, list[float]] = {}
        velocity_l1 = masked_l1 = None
        sends = 0
        for bucket, part in zip(self.buckets, self.parts):
            chosen, waited, velocity, masked = part.sends.take()
            if chosen is None:
                continue
            sends += chosen.numel()
            entries = self._chunk_entry[bucket.index][chosen].tolist()
            for entry, wait in zip(entries, waited.tolist()):
                intervals.setdefault(self._layer_names[bucket.index][entry], []).append(wait)
            if velocity is not None:
                velocity_l1 = velocity if velocity_l1 is None else velocity_l1 + velocity
                masked_l1 = masked if masked_l1 is None else masked_l1 + masked
        if not sends:
            return {}
        stats: dict = {"csc_send_interval_median": {name: float(torch.tensor(waits).median())
                                                    for name, waits in intervals.items()},
                       "csc_chunks_sent": sends}
        if velocity_l1 is not None:
            stats["csc_masked_momentum_share"] = float(masked_l1 / velocity_l1.clamp_min(1e-30))
        return stats

    def end_step(self, applied: bool) -> None:
        for part in self.parts:
            if applied:
                part.commit()
            else:
                part.discard()
        if applied and self.local_step is not None and self.local_step.noise is not None:
            self.local_step.noise.step += 1  # (a skipped step changes nothing)

    def state_dict(self) -> dict:
        parts = [part.state_dict() for part in self.parts]
        per_part = {key: {i: s[key] for i, s in enumerate(parts) if key in s} for key in BucketState.STATE}
        # (the keys of earlier versions always, even empty; the weight decay's velocity where it is kept)
        return {**{key: held for key, held in per_part.items() if held or key in ("residual", "velocity", "noise")},
                "noise_step": self.local_step.noise.step if self.local_step and self.local_step.noise else 0,
                "optimizer_taken": self._taken, "warmup_epochs": self.warmup_epochs,
                "layout": self._layout_signature(), "chunk_size": self.chunk_size}

    rank_label = "CSC"  # in the line a resume on another number of ranks prints

    def rank_rules(self) -> dict[str, str]:
        """How a resume on another number of ranks builds each new rank's state (``state.rank_rules``:
        the per-bucket state is the mean over the old ranks, the rest old rank 0's)."""
        return rank_rules()

    def _layout_signature(self) -> list[list[int]]:
        """Each part's length and sparse section: a state saved under another layout cannot load."""
        return [[b.flat.numel(), b.sparse_elements] for b in self.buckets]

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if (state["layout"], state["chunk_size"]) != (self._layout_signature(), self.chunk_size):
            raise ValueError("csc state was saved with another pool layout (model, comm.bucket_mb or "
                             "comm.chunk_size changed); it cannot be restored")
        saved_warmup = state.get("warmup_epochs")  # (absent in states saved before it was kept)
        if saved_warmup is not None and saved_warmup != self.warmup_epochs:
            # by default the warm-up follows optim.warmup_epochs, so changing that alone would move
            # the switch to sparse, or send a run already sparse back to dense, without a word
            raise CheckpointError(
                f"csc's dense warm-up was {saved_warmup:g} epochs when this checkpoint was saved, now it "
                f"is {self.warmup_epochs:g} (comm.csc_warmup_epochs, or optim.warmup_epochs where that is "
                f"null): resume with comm.csc_warmup_epochs={saved_warmup:g} to keep the run's, or start "
                f"afresh with resume=never")
        for key in BucketState.STATE:  # (a state saved before the noise estimate has none: it starts afresh)
            for index, tensor in state.get(key, {}).items():
                self.parts[int(index)].load_state_dict({key: tensor})
        if "optimizer_taken" in state:
            taken = state["optimizer_taken"]
        else:  # saved before CSC took more than the momentum: begin_step takes the rest
            momenta = state.get("optimizer_momentum")
            taken = None if momenta is None else [{"momentum": m} for m in momenta]
        if taken is not None and (self.optimizer is None or not self.momentum_correction):
            if self.optimizer is not None:  # resumed without momentum correction: the optimizer's own again
                give_back(self.optimizer.param_groups, taken)
            taken = None
        self._taken = taken
        if self.local_step is not None and self.local_step.noise is not None:
            self.local_step.noise.step = int(state.get("noise_step", 0))
