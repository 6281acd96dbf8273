"""One bucket's CSC state on one rank, the step that updates it, and how it is saved and resharded.

The state is what CSC holds back: the residual of each chunk (error feedback), each chunk's age
(steps since it was last sent: the same on every rank, since every rank sends the same chunks), under
momentum correction the velocity of the whole bucket, and the running means of the trust ratio's
noise (``trust.TrustNoise``). A step only *stages* its update; ``commit`` makes it the state, so a step
skipped on every rank (an fp16 overflow) leaves the state as it was. Each state tensor has a spare
of the same size that the step's update is written into and that ``commit`` swaps in, so no step
allocates: on a CPU a fresh allocation of this size page-faults on every step, which costs more
than CSC's arithmetic. Residuals are kept in unscaled units (the caller divides the fp16 loss scale
out on the way in and multiplies it back on the way out), so a changing loss scale never corrupts
them.

Checkpoints keep the keys ``residual``, ``age``, ``velocity``, ``noise`` and ``decay`` per bucket
(``STATE``; a state saved before ``age`` existed starts its chunks at age 0); resumed on another
number of ranks, each new rank takes the mean over the old ranks (``rank_rules``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from gradientflow_repro.comm.base import CommStats, SumFn
from gradientflow_repro.comm.csc.selection import agree_on_norms, hold_back, select_chunks


class Sent(NamedTuple):
    """What ``BucketState.sparsify`` sent."""

    chosen: torch.Tensor  # indices of the chunks sent, ascending, on the state's device
    summed: torch.Tensor  # [len(chosen), chunk_size]: those chunks summed over ranks (a view of a
    # buffer the next sparsify reuses)
    finite: Optional[torch.Tensor]  # with guard_overflow: a 0-d bool on the device, False when
    # some rank's chunk norms were not finite (its gradient overflowed)
    extra: Optional[torch.Tensor] = None  # ``sparsify``'s ``extra``, summed over ranks


class BucketState:
    """One bucket's CSC state on one rank: the residual of its chunks (error feedback) and, under
    momentum correction, the velocity of the whole bucket (chunks, then any dense tail) and the
    running means of its layers' noise (``TrustNoise``), each with a spare of the same size that
    the step's update is written into. ``sparsify`` (steps 2-5) and
    ``add_momentum`` only *stage* their updates; ``commit`` makes them the state (the spares are
    swapped in: no allocation per step) and ``discard`` drops them, so a step skipped on every rank
    leaves the state as it was. ``commit(when=flag)`` decides on the
    device instead, for callers that cannot wait for the host to know whether a step is applied (a
    DDP hook). Used by ``CSCCommunicator`` (one per pool part) and ``csc_hook`` (one per DDP
    bucket)."""

    STATE = ("residual", "age", "velocity", "noise", "decay")  # what is staged, committed and saved

    def __init__(self, residual: Optional[torch.Tensor] = None,
                 velocity: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
                 age: Optional[torch.Tensor] = None, decay: Optional[torch.Tensor] = None) -> None:
        self.residual = residual  # [chunks, chunk_size], fp32; None for a part always sent densely
        # [chunks], fp32: steps since each chunk was last sent (0 after a dense step)
        self.age = age if age is not None or residual is None else torch.zeros(
            residual.shape[0], dtype=torch.float32, device=residual.device)
        self.velocity = velocity  # momentum correction's u, flat over the bucket; None without it
        # [2, layers]: running means of the ranks' own and of their mean's sketched squared norms,
        # for each layer whose trust ratio is corrected for noise (``TrustNoise``); None without
        self.noise = noise
        # under ``comm.weight_decay_in=local``: the weight decay's own velocity, flat over the bucket,
        # kept and applied on each rank (DGC's reference optimizer), never sent; None otherwise
        self.decay = decay
        for name in self.STATE:
            tensor = getattr(self, name)
            setattr(self, f"_spare_{name}", None if tensor is None else torch.empty_like(tensor))
            setattr(self, f"_staged_{name}", None)  # a spare holding this step's update
        self.last_selection: Optional[torch.Tensor] = None  # chunks sent by the last sparsify (tests)
        self.sends = SendLog()  # what the sparse steps sent, for the run's metrics
        self._payload: Optional[torch.Tensor] = None  # chosen chunks + dense tail, kept between steps

    @classmethod
    def zeros(cls, chunks: int, chunk_size: int, device: torch.device, velocity_elements: int = 0,
              noise_layers: int = 0, decay_elements: int = 0) -> "BucketState":
        """A fresh state: a residual of ``chunks`` x ``chunk_size`` (none when ``chunks`` is 0: a
        bucket sent densely), for momentum correction a velocity of ``velocity_elements``, and the
        noise estimate of ``noise_layers`` layers (zeros: nothing observed yet)."""
        residual = torch.zeros((chunks, chunk_size), dtype=torch.float32, device=device) if chunks else None
        velocity = torch.zeros(velocity_elements, dtype=torch.float32, device=device) if velocity_elements else None
        noise = torch.zeros((2, noise_layers), dtype=torch.float32, device=device) if noise_layers else None
        decay = torch.zeros(decay_elements, dtype=torch.float32, device=device) if decay_elements else None
        return cls(residual, velocity, noise, decay=decay)

    def to(self, device: torch.device) -> None:
        """Move the state to ``device`` (a hook's state restored on the CPU, then used on a GPU)."""
        for name in self.STATE:
            tensor = getattr(self, name)
            if tensor is not None and tensor.device != device:
                setattr(self, name, tensor.to(device))
                setattr(self, f"_spare_{name}", torch.empty_like(getattr(self, name)))

    # ------------------------------------------------------------------ one step
    def add_momentum(self, gradient: torch.Tensor, momentum: float) -> torch.Tensor:
        """Stage u <- m u + g (momentum correction) and return it: what is then sent or sparsified."""
        assert self.velocity is not None, "this bucket keeps no velocity"
        self._staged_velocity = torch.add(gradient, self.velocity, alpha=momentum, out=self._spare_velocity)
        return self._staged_velocity

    def add_decay(self, decay: torch.Tensor, momentum: float) -> torch.Tensor:
        """Stage the weight decay's own velocity d <- m d + decay and return it (what this rank adds,
        unsent, to the summed update under ``comm.weight_decay_in=local``)."""
        assert self.decay is not None, "this bucket keeps no weight decay velocity"
        self._staged_decay = torch.add(decay, self.decay, alpha=momentum, out=self._spare_decay)
        return self._staged_decay

    def sparsify(self, gradient: torch.Tensor, density: float, sum_fn: SumFn, norm_sum: SumFn,
                 stats: CommStats, always: Optional[torch.Tensor] = None, mask_after: Optional[float] = None,
                 guard_overflow: bool = False, dense: Optional[torch.Tensor] = None,
                 release_cap: float = 0.0, extra: Optional[torch.Tensor] = None,
                 rank_weights: Optional[torch.Tensor] = None) -> Sent:
        """Steps 2-5 of CSC, in two collectives. ``gradient``: a [chunks, chunk_size] matrix like the
        residual, or a flat tensor of at most chunks * chunk_size elements (a DDP bucket: the rest
        counts as zeros). ``dense``: a flat tensor (the part's dense tail) sent whole in the same
        payload and summed in place. Residual + gradient is chunked; the chunk norms are summed over
        ranks by ``norm_sum`` (so every rank ranks the chunks alike), with the payload's peak
        magnitude as one more summed element when ``sum_fn`` is an fp16 wire (its shared scale);
        the top ``density`` of the chunks plus those in ``always`` are packed, followed by the dense
        tail, and summed over ranks by ``sum_fn``; the sent chunks are cleared in the new
        residual, which is staged. With ``mask_after`` (not None), the sent chunks of the staged
        velocity that waited more than ``mask_after`` steps since their last send are cleared too
        (momentum factor masking: 0 is DGC's rule, every sent chunk; ``momentum.masking_threshold``).
        ``rank_weights`` ([chunks]): each chunk's norm is multiplied by its weight before the ranks
        agree on them, so the ranking can see past a per-layer rescaling of the content
        (``comm.rank_by``); what is sent is unchanged. With ``release_cap`` c > 0, a chosen chunk
        sends at most c times the L2 norm of what this step added to it (``gradient``'s rows): the
        chunk is scaled down to that and the rest stays in its residual instead of being cleared
        (``selection.hold_back``).
        ``extra``: a flat fp32 vector summed over ranks in the norms' small message (the trust ratio's
        noise sketches, ``TrustNoise``); ``Sent.extra`` is its sum.

        A non-finite gradient on any rank makes the summed norms (or the summed peak) non-finite on
        every rank. Without ``guard_overflow`` its chunk has the largest norm, so it is sent and
        reaches every rank (the caller then skips the step and discards). With it, the norms are
        made finite before choosing and ``Sent.finite`` says, on the device, whether they were: for
        ``commit(when=...)``."""
        assert self.residual is not None, "this bucket is always sent densely"
        accumulated = self._spare_residual  # the next residual is built in the spare: no allocation
        if gradient.shape == accumulated.shape:
            torch.add(self.residual, gradient, out=accumulated)
        else:
            accumulated.copy_(self.residual)
            accumulated.view(-1)[:gradient.numel()].add_(gradient.view(-1))
        bounded = hasattr(sum_fn, "sum_bounded")  # an fp16 wire: its scale rides with the norms
        agreed = agree_on_norms(accumulated, norm_sum, stats, bounded, dense, extra, rank_weights)
        norms, bound = agreed.norms, agreed.bound
        finite = None
        if guard_overflow:  # decided on the device: reading it on the host would wait for the GPU
            finite = torch.isfinite(norms.sum()) if bound is None else torch.isfinite(norms.sum() + bound[0])
            norms = torch.nan_to_num(norms)
        chosen = select_chunks(norms, density, always)
        chunk_size, tail = accumulated.shape[1], 0 if dense is None else dense.numel()
        sent_elements = chosen.numel() * chunk_size  # a shape: known on the host without waiting
        payload = self._payload_buffer(sent_elements + tail, accumulated)
        summed = payload[:sent_elements].view(-1, chunk_size)
        torch.index_select(accumulated, 0, chosen, out=summed)
        held = hold_back(summed, self.residual, chosen, release_cap) if release_cap > 0 else None
        if tail:
            payload[sent_elements:].copy_(dense.view(-1))
        if bound is not None:
            sum_fn.sum_bounded(payload, bound, stats)
        else:
            sum_fn(payload, stats)
        if tail:
            dense.view(-1).copy_(payload[sent_elements:])
        if held is None:
            accumulated.index_fill_(0, chosen, 0.0)
        else:
            accumulated.index_copy_(0, chosen, held)
        waited = self.age.index_select(0, chosen).add_(1.0)  # steps since each sent chunk's last send
        velocity = (None if self._staged_velocity is None
                    else self._staged_velocity.view(-1)[:accumulated.numel()].view_as(accumulated))
        masked = None
        if mask_after is not None and velocity is not None:
            masked = chosen if mask_after <= 0 else chosen[waited > mask_after]
        self.sends.record(chosen, waited, velocity, masked)
        if masked is not None:
            velocity.index_fill_(0, masked, 0.0)
        self._staged_age = torch.add(self.age, 1.0, out=self._spare_age).index_fill_(0, chosen, 0.0)
        self._staged_residual, self.last_selection = accumulated, chosen
        return Sent(chosen, summed, finite, agreed.extra)

    def _payload_buffer(self, elements: int, like: torch.Tensor) -> torch.Tensor:
        """The first ``elements`` of a payload buffer kept between steps (allocated once, at the
        largest size seen: a fresh one would page-fault every step). Per state, not per thread:
        ``Sent.summed`` views it after ``sparsify`` returns."""
        if self._payload is None or self._payload.numel() < elements or self._payload.device != like.device:
            self._payload = torch.empty(elements, dtype=like.dtype, device=like.device)
        return self._payload[:elements]

    def stage_noise(self, sample: torch.Tensor, keep: float) -> None:
        """Stage the noise estimate's running means updated by ``sample`` ([2, layers]): ``keep`` x
        the old + (1 - keep) x ``sample``; a layer observed for the first time takes ``sample``."""
        assert self.noise is not None, "this bucket keeps no noise estimate"
        staged = torch.lerp(self.noise, sample, 1.0 - keep, out=self._spare_noise)
        self._staged_noise = torch.where(self.noise[1] == 0, sample, staged, out=staged)

    def commit(self, when: Optional[torch.Tensor] = None) -> None:
        """Make the staged updates the state. ``when`` (a 0-d bool tensor): only if it is true,
        chosen on the device; the update is then copied into the state rather than swapped in,
        and the spare is free again (``scratch``)."""
        for name in self.STATE:
            staged = getattr(self, f"_staged_{name}")
            if staged is None:
                continue
            current = getattr(self, name)
            if when is None:  # the spare becomes the state, the old state the next spare
                setattr(self, name, staged)
                setattr(self, f"_spare_{name}", current)
            else:
                torch.where(when, staged, current, out=current)
        self.discard()

    def discard(self) -> None:
        """Forget the staged updates (a step skipped on every rank)."""
        self._staged_residual = self._staged_age = self._staged_velocity = self._staged_noise = None
        self._staged_decay = None

    @property
    def scratch(self) -> torch.Tensor:
        """The residual's spare, a [chunks, chunk_size] buffer free to use between a commit or
        discard and the next ``sparsify``."""
        assert self._staged_residual is None, "the spare holds a staged residual"
        return self._spare_residual

    @property
    def decay_scratch(self) -> torch.Tensor:
        """A buffer the size of the weight decay velocity for this step's decay term (the spare of
        the velocity, which ``add_momentum`` has not staged yet when the local step runs)."""
        assert self._staged_velocity is None, "the velocity's spare holds a staged velocity"
        return self._spare_velocity

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """``residual``, ``age``, ``velocity``, ``noise`` and ``decay`` (those this bucket keeps), on the CPU."""
        return {name: getattr(self, name).cpu() for name in self.STATE if getattr(self, name) is not None}

    def load_state_dict(self, state: dict) -> None:
        """Copy saved tensors into the state; a tensor this state lacks is adopted (a copy)."""
        for name in self.STATE:
            saved = state.get(name)
            if saved is None:
                continue
            current = getattr(self, name)
            if current is None:
                setattr(self, name, saved.clone())
                setattr(self, f"_spare_{name}", torch.empty_like(saved))
            elif current.shape != saved.shape:
                raise ValueError(f"csc: saved {name} has shape {tuple(saved.shape)}, "
                                 f"not {tuple(current.shape)}")
            else:
                current.copy_(saved)
        self.discard()


class SendLog:
    """What a bucket's sparse steps sent since the last ``take``, kept on the device (reading it on
    the host every step would wait for the GPU): the chunks sent with how many steps each had
    waited, and the L1 norm of the chunks' velocity against what masking erased of it."""

    def __init__(self) -> None:
        self.chosen: list[torch.Tensor] = []
        self.waited: list[torch.Tensor] = []
        self.velocity_l1: Optional[torch.Tensor] = None
        self.masked_l1: Optional[torch.Tensor] = None

    def record(self, chosen: torch.Tensor, waited: torch.Tensor, velocity: Optional[torch.Tensor],
               masked: Optional[torch.Tensor]) -> None:
        """One sparse step: ``chosen`` chunks sent after ``waited`` steps; ``velocity`` the chunks'
        staged velocity ([chunks, chunk_size], None without momentum correction), of which the rows
        ``masked`` are about to be cleared."""
        if len(self.chosen) > 10_000:  # nobody takes them (a caller without metrics): keep the newest
            self.chosen, self.waited = self.chosen[5_000:], self.waited[5_000:]
        self.chosen.append(chosen)
        self.waited.append(waited)
        if velocity is None:
            return
        total = velocity.abs().sum()
        erased = velocity.index_select(0, masked).abs().sum() if masked is not None and masked.numel() else 0.0 * total
        self.velocity_l1 = total if self.velocity_l1 is None else self.velocity_l1 + total
        self.masked_l1 = erased if self.masked_l1 is None else self.masked_l1 + erased

    def take(self) -> tuple[Optional[torch.Tensor], ...]:
        """(chunks sent, steps each waited, velocity L1, erased L1) since the last call, each None
        where nothing was recorded, and start afresh."""
        taken = (torch.cat(self.chosen) if self.chosen else None, torch.cat(self.waited) if self.waited else None,
                 self.velocity_l1, self.masked_l1)
        self.__init__()
        return taken


# The communicator's own keys, the same on every rank (old rank 0's on a resume on another number of
# ranks). ``optimizer_momentum``: what states saved before CSC took more than the momentum hold.
SAME_ON_EVERY_RANK = ("noise_step", "optimizer_taken", "warmup_epochs", "layout", "chunk_size", "optimizer_momentum")


def rank_rules() -> dict[str, str]:
    """On another number of ranks, each new rank's per-bucket state (``BucketState.STATE``:
    residual, age, velocity, noise, decay) is the mean over the old ranks (the ages are the same on every
    rank, so their mean is each): the mean over ranks of what is held
    back (what the sum, divided by the world size, will deliver) is unchanged, whatever the new
    world size; the noise estimate, equal on every rank, is kept. The rest
    (``SAME_ON_EVERY_RANK``) is the same on every rank: old rank 0's."""
    return {**{key: "mean" for key in BucketState.STATE}, **{key: "same" for key in SAME_ON_EVERY_RANK}}
