"""Coarse-grained sparse communication (CSC) over the lazy-allreduce pool.

Element-wise top-k sparsification (Deep Gradient Compression) needs an allgather of indices and
values whose volume grows with the number of workers. GradientFlow sparsifies coarsely instead:
1. each pool part's weight gradients are cut into chunks of ``chunk_size`` elements;
2. each rank adds its new gradient to its residual (error feedback) and computes the L1 norm of
   every chunk;
3. the vector of chunk norms (one float per chunk: tiny) is allreduced, so every rank ranks the
   chunks by the same global importance and picks the same top ``density`` fraction (ties broken
   by chunk index, so the choice is deterministic);
4. the chosen chunks are packed contiguously and allreduced densely by the chosen algorithm
   (ring, fp16 wire ...): no indices travel, and the volume is ``density`` times the dense one;
5. the chunks not chosen stay in the per-rank residual and are added to the next step, so no
   gradient is ever dropped, only delayed.

Two collectives per pool part, no more. Each collective is a latency (log2(N) of them for a small
one, 2(N-1) for a ring), and at 512 GPUs latency, not volume, is what CSC leaves. So:
- the norms' allreduce (small: recursive doubling or NCCL's tree) also carries the fp16 wire's
  scale: each rank appends its largest magnitude in the payload as one more summed element. The
  sum of the ranks' peaks bounds every partial and final sum of the payload, so the shared power-
  of-two scale chosen from it (``compression.Fp16Wire.sum_bounded``) cannot overflow, and no
  separate max-allreduce is needed;
- one-dimensional tensors (BatchNorm, biases: small and sensitive) live in the same pool part as
  the weights made ready with them, after its chunks (the part's dense tail, ``pool.csc_parts``),
  and travel densely in the same payload as the chosen chunks: no part of their own.

Momentum correction (DGC, Lin et al. 2018): while sparsifying, momentum is accumulated *before*
sparsification, in a local velocity u <- m u + g whose sum v <- v + u is what gets chunked and sent;
sent chunks of v (and, with momentum factor masking, of u) are cleared. The dense tail sends its u.
The optimizer's own momentum is then set to 0 so momentum is not applied twice; it is restored
during dense phases. At the switch to sparse, each rank's velocity starts from the optimizer's
momentum buffer, so the dense warm-up's momentum carries on instead of restarting from zero.

Momentum correction under LARS (``LocalStep``). LARS rescales each layer's gradient, with weight
decay, to ``trust * |w| / (|g| + wd |w|)`` *before* it enters the momentum, so a consistent
gradient direction builds up steps of up to 1/(1 - m) = 10 times that size. DGC's correction moves
the momentum before the sum over ranks; had LARS stayed in the optimizer it would rescale the
accumulated velocity to one step's size, and the momentum's gain would be lost: sparse training
ran at a fraction of its learning rate and took 3.5 times the epochs of dense training on the
digits recipe. So while CSC sends sparsely, what the optimizer does to a gradient before its
momentum moves with the momentum: each rank adds the weight decay to its own gradient (SGD and
Lars, as DGC does) and, for the layers Lars adapts, rescales it by the trust ratio, before
``u <- m u + g``; the optimizer's groups run as plain SGD (momentum, weight decay and adaptation
handed to CSC). It is DGC's correction with LARS where LARS puts it: when every chunk is sent and
the ranks' gradients agree it is dense LARS step for step (the lockstep test). With different
gradients each rank's ratio would come from its own |g|, whose noise makes it larger than the mean
gradient's (by up to sqrt(N) when noise dominates), so the steps would be that much shorter than
dense LARS's; ``TrustNoise`` estimates that factor from sketches riding with the chunk norms and
divides it out (``comm.trust_noise_correction``). Optimizers that adapt in other ways (apex's
LARC rescales every update, velocity included), Nesterov momentum and dampening are refused rather
than run wrongly. Should
the density schedule return to dense, the optimizer gets its settings back and its momentum
restarts from the mean gradient (the velocities are per rank).

Release cap (ours, not the paper's). A chunk that waited k steps holds k steps of updates (up to
1/(1 - m) times more under momentum correction), which DGC's rule sends at once when it is chosen.
On the digits recipe such bursts made evaluations fall by 39 and 76 points at densities 0.03 and
0.05, and by 5 at 0.01. With ``release_cap`` c > 0 a chosen chunk sends at most c times the L2 norm of what
this step added to it (its velocity), per rank, and the rest stays in its residual, still counted
in its norm, so it is likely chosen again: the burst lands over several steps. Nothing is dropped
(sent + residual is unchanged) and the ranks still choose the same chunks; the cap changes what
each rank puts into the sum, not which chunks are summed.

Training starts dense for ``warmup_epochs`` (dense warm-up); optionally the density then falls
over ``density_ramp_epochs`` epochs instead of at once, exponentially as in DGC's sparsity warm-up
(the k-th of R epochs sends density^(k/(R+1)): 0.56, 0.32, 0.18 for density 0.1 and R = 3). With
``density`` 1 nothing is sparsified and this is exactly lazy allreduce.

State per rank (residual v of each part's chunks, velocity u of the whole part, the trust ratio's
noise estimate) is saved in that rank's checkpoint. Updates to it are staged and committed by
``end_step``: a step skipped on every rank (fp16 overflow) leaves the state as it was. Each state
tensor has a spare of the same size that the step's update is written into and that ``end_step``
swaps in, so no step allocates: a fresh allocation of this size page-faults every time on the CPU,
which made CSC's own work cost up to five times more. Residuals are kept in unscaled units (the fp16
loss scale is divided out on the way in and multiplied back on the way out), so a changing loss
scale never corrupts them.

One object, ``BucketState``, holds a bucket's state and does steps 2-5 on it; ``CSCCommunicator``
keeps one per pool part, and the DDP communication hook ``csc_hook`` (``comm/hooks.py``) one per DDP
bucket. The hook cannot wait for the host to learn whether a step will be applied, so it commits on
the device: after an overflow the residual is kept and the bucket arrives as inf everywhere.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro.checkpoint import CheckpointError
from gradientflow_repro.comm.base import CommStats, GradScale, SumFn, scratch
from gradientflow_repro.comm.compression import peak_magnitude
from gradientflow_repro.comm.knobs import TRUST_SKETCH_BUCKETS
from gradientflow_repro.comm.lazy import Bucket, LazyAllreduce
from gradientflow_repro.comm.pool import csc_parts
from gradientflow_repro.comm.recursive_doubling import small_sum
from gradientflow_repro.optim import is_lars


def chunk_l1_norms(chunks: torch.Tensor) -> torch.Tensor:
    """L1 norm of every row of a [chunks, chunk_size] matrix. On a GPU one fused reduction (4 bytes
    read per element, as ``perfmodel`` counts it); on a CPU |x| into a buffer kept between calls,
    then row sums: PyTorch's CPU 1-norm reduction is not vectorized (0.48 ns per element on one
    thread against 0.10, a fifth of CSC's whole local work)."""
    if chunks.device.type != "cpu":
        return torch.linalg.vector_norm(chunks, ord=1, dim=1, dtype=torch.float32)
    magnitudes = scratch("chunk magnitudes", chunks.numel(), chunks.dtype, chunks.device).view_as(chunks)
    return torch.abs(chunks, out=magnitudes).sum(1, dtype=torch.float32)


def select_chunks(global_norms: torch.Tensor, density: float,
                  always: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices (ascending) of the ``ceil(density * n)`` largest norms; ties go to the lower index.
    Chunks listed in ``always`` are chosen on top of those."""
    count = min(global_norms.numel(), max(1, math.ceil(density * global_norms.numel())))
    if always is not None and always.numel():
        global_norms = global_norms.index_fill(0, always, math.inf)
        count = min(global_norms.numel(), count + always.numel())
    order = torch.sort(global_norms, descending=True, stable=True).indices[:count]
    return order.sort().values


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

    STATE = ("residual", "velocity", "noise")  # what is staged, committed and saved

    def __init__(self, residual: Optional[torch.Tensor] = None,
                 velocity: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None) -> None:
        self.residual = residual  # [chunks, chunk_size], fp32; None for a part always sent densely
        self.velocity = velocity  # momentum correction's u, flat over the bucket; None without it
        # [2, layers]: running means of the ranks' own and of their mean's sketched squared norms,
        # for each layer whose trust ratio is corrected for noise (``TrustNoise``); None without
        self.noise = noise
        for name in self.STATE:
            tensor = getattr(self, name)
            setattr(self, f"_spare_{name}", None if tensor is None else torch.empty_like(tensor))
            setattr(self, f"_staged_{name}", None)  # a spare holding this step's update
        self.last_selection: Optional[torch.Tensor] = None  # chunks sent by the last sparsify (tests)
        self._payload: Optional[torch.Tensor] = None  # chosen chunks + dense tail, kept between steps

    @classmethod
    def zeros(cls, chunks: int, chunk_size: int, device: torch.device, velocity_elements: int = 0,
              noise_layers: int = 0) -> "BucketState":
        """A fresh state: a residual of ``chunks`` x ``chunk_size`` (none when ``chunks`` is 0: a
        bucket sent densely), for momentum correction a velocity of ``velocity_elements``, and the
        noise estimate of ``noise_layers`` layers (zeros: nothing observed yet)."""
        residual = torch.zeros((chunks, chunk_size), dtype=torch.float32, device=device) if chunks else None
        velocity = torch.zeros(velocity_elements, dtype=torch.float32, device=device) if velocity_elements else None
        noise = torch.zeros((2, noise_layers), dtype=torch.float32, device=device) if noise_layers else None
        return cls(residual, velocity, noise)

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

    def sparsify(self, gradient: torch.Tensor, density: float, sum_fn: SumFn, norm_sum: SumFn,
                 stats: CommStats, always: Optional[torch.Tensor] = None, mask_velocity: bool = False,
                 guard_overflow: bool = False, dense: Optional[torch.Tensor] = None,
                 release_cap: float = 0.0, extra: Optional[torch.Tensor] = None) -> Sent:
        """Steps 2-5 of CSC, in two collectives. ``gradient``: a [chunks, chunk_size] matrix like the
        residual, or a flat tensor of at most chunks * chunk_size elements (a DDP bucket: the rest
        counts as zeros). ``dense``: a flat tensor (the part's dense tail) sent whole in the same
        payload and summed in place. Residual + gradient is chunked; the chunk norms are summed over
        ranks by ``norm_sum`` (so every rank ranks the chunks alike), with the payload's peak
        magnitude as one more summed element when ``sum_fn`` is an fp16 wire (its shared scale);
        the top ``density`` of the chunks plus those in ``always`` are packed, followed by the dense
        tail, and summed over ranks by ``sum_fn``; the sent chunks are cleared in the new
        residual, which is staged. With ``mask_velocity``, the sent chunks of the staged velocity
        are cleared too (DGC's momentum factor masking). With ``release_cap`` c > 0, a chosen chunk
        sends at most c times the L2 norm of what this step added to it (``gradient``'s rows): the
        chunk is scaled down to that and the rest stays in its residual instead of being cleared.
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
        norms = chunk_l1_norms(accumulated)
        chunks = norms.numel()
        riders = [] if extra is None else [extra]  # what rides in the norms' small message
        bounded = hasattr(sum_fn, "sum_bounded")  # an fp16 wire: its scale rides with the norms
        if bounded:
            peak = peak_magnitude(accumulated)
            if dense is not None and dense.numel():
                peak = torch.maximum(peak, peak_magnitude(dense))
            riders.append(peak)
        if riders:
            norms = torch.cat([norms, *riders])
        norm_sum(norms, stats)  # every rank now ranks chunks by the same global norms
        bound = norms[-1:] if bounded else None
        summed_extra = None if extra is None else norms[chunks:chunks + extra.numel()]
        norms = norms[:chunks]
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
        held = self._hold_back(summed, chosen, release_cap) if release_cap > 0 else None
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
        if mask_velocity and self._staged_velocity is not None:
            self._staged_velocity.view(-1)[:accumulated.numel()].view_as(accumulated).index_fill_(0, chosen, 0.0)
        self._staged_residual, self.last_selection = accumulated, chosen
        return Sent(chosen, summed, finite, summed_extra)

    def _hold_back(self, chosen_rows: torch.Tensor, chosen: torch.Tensor, cap: float) -> torch.Tensor:
        """Scale each of ``chosen_rows`` (residual + this step's addition, about to be sent) down to at
        most ``cap`` times the L2 norm of this step's addition, in place; return what was held back
        (this thread's scratch buffer, valid until the next sparsify), which stays in the residual.
        Nothing is dropped: held back + sent is the chunk."""
        held = scratch("csc held back", chosen_rows.numel(), chosen_rows.dtype, chosen_rows.device).view_as(chosen_rows)
        torch.index_select(self.residual, 0, chosen, out=held)
        step_norms = torch.sub(chosen_rows, held, out=held).norm(dim=1, keepdim=True)  # this step's rows
        tiny = torch.finfo(chosen_rows.dtype).tiny
        share = (step_norms * cap / chosen_rows.norm(dim=1, keepdim=True).clamp_min(tiny)).clamp_(max=1.0)
        # a chunk this step added nothing to (a parameter without gradient or weight decay) is sent
        # whole: capped at 0 it would keep its residual, and its norm would keep it chosen, forever
        share = torch.where(step_norms > 0, share, 1.0)
        torch.mul(chosen_rows, 1.0 - share, out=held)
        chosen_rows.sub_(held)
        return held

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
        self._staged_residual = self._staged_velocity = self._staged_noise = None

    @property
    def scratch(self) -> torch.Tensor:
        """The residual's spare, a [chunks, chunk_size] buffer free to use between a commit or
        discard and the next ``sparsify``."""
        assert self._staged_residual is None, "the spare holds a staged residual"
        return self._spare_residual

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """``residual``, ``velocity`` and ``noise`` (those this bucket keeps), on the CPU."""
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


def adapts(group: dict) -> bool:
    """Whether timm's ``Lars`` rescales this parameter group (it does with weight decay or
    ``always_adapt``; BatchNorm and bias groups have neither). SGD's groups never."""
    return "trust_coeff" in group and (group.get("weight_decay", 0.0) != 0 or bool(group.get("always_adapt", False)))


NOISE_KEEP = 0.9  # the noise factor's running means span about 10 steps
SKETCH_SEED = 0x5EED  # the sketch's signs: the same on every rank
SIGN_SHIFTS = 1009  # step s takes the signs from element s mod 1009 on: a new sketch each step


def sketch_into(out: torch.Tensor, gradient: torch.Tensor, signs: torch.Tensor, buffer: torch.Tensor) -> None:
    """``out[b]`` = the sum of ``signs[j] * gradient[j]`` over the elements j with j mod len(out) = b
    (``signs``: +-1, at least as long as ``gradient``; ``buffer``: as long, free to overwrite)."""
    n, k = gradient.numel(), out.numel()
    signed = buffer[:n]
    torch.mul(gradient, signs[:n], out=signed)
    whole = n - n % k
    torch.sum(signed[:whole].view(-1, k), 0, dtype=out.dtype, out=out)
    if whole < n:
        out[:n - whole].add_(signed[whole:])


def sketch_signs(elements: int, device: torch.device) -> torch.Tensor:
    """``elements`` random signs (+-1, int8: one byte per element), the same on every rank."""
    signs = torch.randint(0, 2, (elements,), generator=torch.Generator().manual_seed(SKETCH_SEED), dtype=torch.int8)
    return signs.mul_(2).sub_(1).to(device)


class TrustNoise:
    """Each rank's LARS trust ratio, corrected for the noise of its own gradient (ours, not the paper's).

    Under momentum correction each rank rescales its own gradient g_i by LARS's ratio
    ``trust |w| / (|g| + wd |w|)`` before the sum (``LocalStep``). Dense LARS takes |g| of the mean
    gradient; a rank's own |g_i| is larger by the noise of its smaller batch, by a factor c with
    c^2 = mean_i |g_i|^2 / |mean_i g_i|^2: up to sqrt(N) where noise dominates (on the digits recipe
    at 4 ranks c is 1.5-2.0 per layer), so every sparse step was that much shorter than dense LARS's,
    a shortfall that grows with the world size. The mean is known only after the sum, and a third
    collective per part is ruled out, so c is estimated from the steps before and each rank divides
    its own |g_i| by it:
    - each rank sketches each adapted layer's raw gradient: a fixed random sign per element (the
      same on every rank), element j summed into bucket j mod 64. A sketch is linear, so the sum of
      the ranks' sketches is the sketch of their sum; the squared norm of a sketch estimates the
      squared norm of what it sketches, to about sqrt(2/64) = 18% per step. Each step shifts the
      signs by one element (the same shift on every rank), so the error changes from step to step
      even where the mean gradient does not;
    - each layer's sketch and the rank's own sketched squared norm ride in the chunk norms' small
      message (``BucketState.sparsify``'s ``extra``): 65 floats per layer, no collective of its own;
    - c^2 = (running mean of the ranks' own sketched squared norms) / (running mean of the squared
      sketch of their mean), over about 10 steps (``NOISE_KEEP``): the ratio changes slowly, so
      averaging costs little and halves the sketch's error. Both sides come from the same sketch,
      so when the ranks' gradients agree c is 1 and this is dense LARS (the lockstep test). c is
      kept within [1, sqrt(N)].
    With nothing observed yet (the first sparse step) c is 1: each rank's own ratio. The running
    means are part of the pool part's ``BucketState`` (staged, committed, checkpointed); the shift,
    ``step``, is saved with the communicator's state. Memory: one byte of sign per element of the
    largest layer; the signed gradient is written into the part's spare residual, free until
    ``sparsify``."""

    def __init__(self, entries: list[list[tuple[nn.Parameter, int, int]]], groups: list[dict],
                 buckets: list[Bucket], world: int) -> None:
        self.world = world
        # per bucket: (entry index, sketch buckets) of each layer Lars adapts in the sparse section
        self.layers = [[(index, min(TRUST_SKETCH_BUCKETS, param.numel()))
                        for index, (param, offset, group) in enumerate(found)
                        if adapts(groups[group]) and offset + param.numel() <= bucket.sparse_elements]
                       for found, bucket in zip(entries, buckets)]
        self.entries = entries
        device = buckets[0].flat.device if buckets else torch.device("cpu")
        self.layer_of = [torch.tensor([layer for layer, (_, k) in enumerate(layers) for _ in range(k)],
                                      dtype=torch.long, device=device) for layers in self.layers]
        longest = max((entries[b][index][0].numel() for b, layers in enumerate(self.layers)
                       for index, _ in layers), default=0)
        self.signs = sketch_signs(longest + SIGN_SHIFTS, device)  # each layer is sketched alone: all
        # layers may use the same signs
        self.step = 0  # steps applied (the same on every rank): the signs' shift

    def layers_in(self, bucket_index: int) -> int:
        return len(self.layers[bucket_index])

    def sketch(self, bucket: Bucket, gradient: torch.Tensor, state: BucketState) -> Optional[torch.Tensor]:
        """This rank's part of the noise message for ``bucket`` (``gradient`` laid out like
        ``bucket.flat``; ``state``: the bucket's, whose spare residual is used as a buffer): each
        layer's sketched squared norm, then each layer's sketch; None for a bucket without layers."""
        layers = self.layers[bucket.index]
        if not layers:
            return None
        out = torch.zeros(len(layers) + self.layer_of[bucket.index].numel(), dtype=torch.float32,
                          device=gradient.device)
        at, signs, buffer = len(layers), self.signs[self.step % SIGN_SHIFTS:], state.scratch.view(-1)
        for index, k in layers:
            param, offset, _ = self.entries[bucket.index][index]
            sketch_into(out[at:at + k], gradient[offset:offset + param.numel()], signs, buffer)
            at += k
        self._squared_norms(bucket, out[len(layers):], into=out[:len(layers)])
        return out

    def _squared_norms(self, bucket: Bucket, sketches: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
        """Adds each layer's squared sketch norm to ``into`` (one value per layer); returns it."""
        return into.index_add_(0, self.layer_of[bucket.index], sketches.square())

    def observe(self, bucket: Bucket, state: BucketState, summed: torch.Tensor) -> None:
        """Stage the running means in ``state`` from ``summed``: the ranks' ``sketch`` summed."""
        layers = len(self.layers[bucket.index])
        mean_squared = self._squared_norms(bucket, summed[layers:],
                                           into=torch.zeros(layers, dtype=torch.float32, device=summed.device))
        state.stage_noise(torch.stack([summed[:layers] / self.world, mean_squared / self.world**2]), NOISE_KEEP)

    def factors(self, bucket: Bucket, state: BucketState) -> dict[int, torch.Tensor]:
        """Entry index -> c (0-d, on the device) for each of ``bucket``'s layers, from the
        committed running means; 1 where nothing is observed yet."""
        own, mean = state.noise
        squared = torch.where(mean > 0, own / mean, 1.0).clamp_(1.0, float(self.world))
        return {index: c for (index, _), c in zip(self.layers[bucket.index], squared.sqrt().unbind())}


class LocalStep:
    """What the optimizer does to a gradient before its momentum, done instead by momentum
    correction to each rank's own gradient (module docstring): ``g <- g + wd w`` and, in the groups
    Lars adapts, ``g <- ratio * (g + wd w)`` (``lars_rescale_``), with the ratio corrected for the
    noise of the rank's own gradient (``TrustNoise``, unless ``noise_correction`` is off). Knows,
    for every pool part, each parameter's optimizer group and where its gradient lies."""

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: list[Bucket], world: int = 1,
                 noise_correction: bool = True) -> None:
        if not (is_lars(optimizer) or isinstance(optimizer, torch.optim.SGD)):
            raise ValueError(f"csc: momentum correction with {type(optimizer).__name__}: only SGD and timm's "
                             "Lars are supported (an optimizer that rescales every update would rescale CSC's "
                             "accumulated velocity); use optim.name=lars or comm.momentum_correction=false")
        for group in optimizer.param_groups:
            if group.get("nesterov") or group.get("dampening", 0) or group.get("trust_clip"):
                raise ValueError("csc: momentum correction keeps plain momentum (u <- m u + g): it does not "
                                 "support Nesterov momentum, dampening or Lars(trust_clip=True)")
        group_of = {param: index for index, group in enumerate(optimizer.param_groups)
                    for param in group["params"]}
        self.entries = [[(param, offset, group_of[param]) for param, offset in zip(bucket.params, bucket.offsets)
                         if param in group_of] for bucket in buckets]
        self.noise = (TrustNoise(self.entries, optimizer.param_groups, buckets, world)
                      if noise_correction and world > 1 else None)

    def noise_layers(self, bucket_index: int) -> int:
        """How many layers of the bucket have their trust ratio corrected for noise."""
        return self.noise.layers_in(bucket_index) if self.noise is not None else 0

    def apply_(self, bucket: Bucket, gradient: torch.Tensor, settings: list[dict],
               state: Optional[BucketState] = None) -> Optional[torch.Tensor]:
        """Apply, in place, the optimizer's pre-momentum step to ``bucket``'s gradients in ``gradient``
        (laid out like ``bucket.flat``); ``settings``: each optimizer group's own settings (those
        CSC has taken over included). With ``state`` (the bucket's, holding a noise estimate), the
        trust ratios are corrected by its estimate, and the noise sketch of the gradients as they
        came (``TrustNoise.sketch``) is returned, to ride with the chunk norms; else None."""
        noise = self.noise if state is not None and state.noise is not None else None
        sketch = noise.sketch(bucket, gradient, state) if noise is not None else None
        factors = noise.factors(bucket, state) if noise is not None else {}
        rescaled = []
        for index, (param, offset, group) in enumerate(self.entries[bucket.index]):
            own, view = settings[group], gradient[offset:offset + param.numel()]
            if adapts(own):
                rescaled.append((view, param.detach().reshape(-1), own, factors.get(index, 1.0)))
            elif own.get("weight_decay", 0.0):
                view.add_(param.detach().reshape(-1), alpha=own["weight_decay"])
        if rescaled:
            lars_rescale_(*map(list, zip(*rescaled)))
        return sketch


def lars_rescale_(gradients: list[torch.Tensor], weights: list[torch.Tensor], groups: list[dict],
                  noise: Optional[list[Union[float, torch.Tensor]]] = None) -> None:
    """``g <- ratio * (g + wd w)`` in place for each gradient, with its group's ``weight_decay``,
    ``trust_coeff`` and ``eps``: timm ``Lars``'s step before its momentum, with its ratio
    (``timm.optim.lars._lars_trust_ratio``, private there): ``trust |w| / (|g| + wd |w| + eps)``,
    1 where ``|w|`` or ``|g|`` is 0. ``noise``: per gradient, the factor c that ``|g|`` is divided
    by (``TrustNoise``); 1 without."""
    weight_norms, gradient_norms = torch._foreach_norm(weights), torch._foreach_norm(gradients)
    for gradient, weight, w_norm, g_norm, group, c in zip(gradients, weights, weight_norms, gradient_norms, groups,
                                                          noise or [1.0] * len(gradients)):
        decay = group["weight_decay"]
        ratio = group["trust_coeff"] * w_norm / (g_norm / c + w_norm * decay + group["eps"])
        ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, 1.0)
        gradient.add_(weight, alpha=decay).mul_(ratio)


class CSCCommunicator(LazyAllreduce):
    def __init__(self, device: torch.device, sum_fn: SumFn, bucket_bytes: int, overlap: bool,
                 chunk_size: int, density: float, warmup_epochs: float,
                 momentum_correction: bool = True, momentum_masking: bool = True,
                 density_ramp_epochs: int = 0, release_cap: float = 0.0,
                 trust_noise_correction: bool = True) -> None:
        super().__init__(device, sum_fn, bucket_bytes, overlap)
        if not 0 < density <= 1:
            raise ValueError(f"config key 'comm.density' = {density}: must be in (0, 1]")
        if density_ramp_epochs < 0:
            raise ValueError(f"config key 'comm.density_ramp_epochs' = {density_ramp_epochs}: must be >= 0")
        self.chunk_size, self.density, self.warmup_epochs = chunk_size, density, warmup_epochs
        self.density_ramp_epochs = density_ramp_epochs
        self.density_now = 1.0
        self.momentum_correction, self.momentum_masking = momentum_correction, momentum_masking
        self.trust_noise_correction = trust_noise_correction
        if not (math.isfinite(release_cap) and release_cap >= 0):
            raise ValueError(f"config key 'comm.release_cap' = {release_cap}: must be a finite number >= 0 (0: no cap)")
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

    def chunks(self, bucket: Bucket) -> torch.Tensor:
        """The part's sparse section as a [chunks, chunk_size] matrix (a view)."""
        return bucket.flat[:bucket.sparse_elements].view(-1, self.chunk_size)

    def attach(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> nn.Module:
        super().attach(model, optimizer)
        if self.momentum_correction and optimizer is not None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            self.local_step = LocalStep(optimizer, self.buckets, world, self.trust_noise_correction)
        step = self.local_step
        self.parts = [BucketState.zeros(bucket.sparse_elements // self.chunk_size, self.chunk_size,
                                        bucket.flat.device,
                                        velocity_elements=bucket.flat.numel() if self.momentum_correction else 0,
                                        noise_layers=step.noise_layers(bucket.index) if step else 0)
                      for bucket in self.buckets]
        return model

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
        """The fraction of chunks sent in ``epoch``: 1 during the dense warm-up, then the ramp."""
        if epoch < self.warmup_epochs:
            return 1.0
        ramp_epoch = math.floor(epoch - self.warmup_epochs) + 1
        if ramp_epoch <= self.density_ramp_epochs:
            return self.density ** (ramp_epoch / (self.density_ramp_epochs + 1))
        return self.density

    def begin_step(self, epoch: float, grad_scale: GradScale = None) -> None:
        # a tensor stays a tensor: comparing it with 1 on the host would wait for the GPU
        self.grad_scale = None if isinstance(grad_scale, (int, float)) and grad_scale == 1 else grad_scale
        self.density_now = self.density_at(epoch)
        self.sparse_now = self.density_now < 1
        self._hand_settings_to_optimizer(not self.uses_velocity)
        if self.optimizer is not None:  # read by the communication thread: built once per step
            self._settings = self.optimizer_settings()

    # what CSC takes from each optimizer group for a sparse phase, and the value the group keeps
    TAKEN = (("momentum", 0.0), ("weight_decay", 0.0), ("always_adapt", False))

    def _hand_settings_to_optimizer(self, optimizer_owns: bool) -> None:
        """Take momentum, weight decay and Lars's adaptation (``TAKEN``) from the optimizer's groups
        for a sparse phase, or give them back for a dense one (its momentum then restarts: the
        velocities are per rank). Taking is per setting and idempotent, so a state saved by an
        older version (momentum only) completes itself."""
        if self.optimizer is None or not self.momentum_correction:
            return
        groups = self.optimizer.param_groups
        if optimizer_owns:
            if self._taken is not None:
                self._give_back(self._taken)
                for state in self.optimizer.state.values():
                    state.pop("momentum_buffer", None)
                self._taken = None
            return
        if self._taken is None:
            self._taken = [{} for _ in groups]
            self._velocity_from_optimizer()
        for group, taken in zip(groups, self._taken):
            for key, plain in self.TAKEN:
                if key in group and key not in taken:
                    taken[key], group[key] = group[key], plain

    def _give_back(self, taken: list[dict]) -> None:
        for group, own in zip(self.optimizer.param_groups, taken):
            group.update(own)

    def _velocity_from_optimizer(self) -> None:
        """Start each velocity from the optimizer's momentum buffers (the dense phase's velocity of
        the mean gradient): the ranks' velocities then sum to the world size times it, which the
        mean over ranks turns back into it, so the switch to sparse loses no momentum."""
        for bucket, part in zip(self.buckets, self.parts):
            if part.velocity is None:
                continue
            for param, offset in zip(bucket.params, bucket.offsets):
                buffer = self.optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None:
                    part.velocity[offset:offset + param.numel()].copy_(buffer.reshape(-1))

    def optimizer_settings(self) -> list[dict]:
        """Each optimizer group's own settings, those CSC has taken over included."""
        taken = self._taken or [{} for _ in self.optimizer.param_groups]
        return [{**group, **own} for group, own in zip(self.optimizer.param_groups, taken)]

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
        if self.uses_velocity and self.local_step is not None:
            sketch = self.local_step.apply_(bucket, flat, self._settings, part)
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
                                 self.sum_fn, self.norm_sum, self.stats, mask_velocity=self.momentum_masking,
                                 dense=tail, release_cap=self.release_cap, extra=sketch)
            if sketch is not None:
                self.local_step.noise.observe(bucket, part, sent.extra)
            self.chunks(bucket).zero_().index_copy_(0, sent.chosen, sent.summed)
        if self.grad_scale is not None:
            flat.mul_(self.grad_scale)
        if part.residual is None:
            super().reduce_bucket(bucket)

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
        return {"residual": {i: s["residual"] for i, s in enumerate(parts) if "residual" in s},
                "velocity": {i: s["velocity"] for i, s in enumerate(parts) if "velocity" in s},
                "noise": {i: s["noise"] for i, s in enumerate(parts) if "noise" in s},
                "noise_step": self.local_step.noise.step if self.local_step and self.local_step.noise else 0,
                "optimizer_taken": self._taken, "warmup_epochs": self.warmup_epochs,
                "layout": self._layout_signature(), "chunk_size": self.chunk_size}

    rank_label = "CSC"  # in the line a resume on another number of ranks prints

    def rank_rules(self) -> dict[str, str]:
        """On another number of ranks, each new rank's per-bucket state (``BucketState.STATE``:
        residual, velocity, noise) is the mean over the old ranks: the mean over ranks of what is held
        back (what the sum, divided by the world size, will deliver) is unchanged, whatever the new
        world size; the noise estimate, equal on every rank, is kept. The rest is the same on every
        rank: old rank 0's."""
        return {**{key: "mean" for key in BucketState.STATE},
                **{key: "same" for key in ("noise_step", "optimizer_taken", "warmup_epochs", "layout",
                                           "chunk_size", "optimizer_momentum")}}

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
                self._give_back(taken)
            taken = None
        self._taken = taken
        if self.local_step is not None and self.local_step.noise is not None:
            self.local_step.noise.step = int(state.get("noise_step", 0))
