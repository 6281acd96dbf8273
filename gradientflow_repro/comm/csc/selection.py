"""Which chunks a step sends: chunk norms, the ranks' agreement on them, the top-density choice,
the release cap, and the density schedule (steps 2-3 of the algorithm in ``csc/__init__.py``).

Every rank must send the same chunks, or the dense sum of the payload would add unrelated rows.
So the choice is made from norms summed over ranks (one small collective per pool part) and is
deterministic: the largest ``density`` fraction, ties to the lower chunk index. Whatever else must
be agreed per part (the fp16 wire's scale, the trust ratio's noise sketches) rides in the same
small message instead of costing a collective of its own.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from gradientflow_repro.comm.base import CommStats, SumFn, scratch
from gradientflow_repro.comm.compression import peak_magnitude


def chunk_l1_norms(chunks: torch.Tensor) -> torch.Tensor:
    """L1 norm of every row of a [chunks, chunk_size] matrix. On a GPU one fused reduction (4 bytes
    read per element, as ``perfmodel`` counts it); on a CPU |x| into a buffer kept between calls,
    then row sums, because PyTorch's CPU 1-norm reduction is not vectorized and is several times
    slower than these two vectorized passes (measured: see
    docs/notes/2026-12-04-measurements-moved-from-docstrings-library.md)."""
    if chunks.device.type != "cpu":
        return torch.linalg.vector_norm(chunks, ord=1, dim=1, dtype=torch.float32)
    magnitudes = scratch("chunk magnitudes", chunks.numel(), chunks.dtype, chunks.device).view_as(chunks)
    return torch.abs(chunks, out=magnitudes).sum(1, dtype=torch.float32)


class Agreed(NamedTuple):
    """What every rank knows after the norms' small collective (``agree_on_norms``)."""

    norms: torch.Tensor  # each chunk's L1 norm, summed over ranks
    bound: Optional[torch.Tensor]  # [1]: the ranks' peak magnitudes summed (the fp16 wire's bound), or None
    extra: Optional[torch.Tensor]  # the riders' ``extra``, summed over ranks, or None


def agree_on_norms(rows: torch.Tensor, norm_sum: SumFn, stats: CommStats, bounded: bool,
                   dense: Optional[torch.Tensor] = None, extra: Optional[torch.Tensor] = None,
                   weights: Optional[torch.Tensor] = None) -> Agreed:
    """Sum the chunk norms of ``rows`` ([chunks, chunk_size]) over ranks with ``norm_sum`` (a small
    message: recursive doubling or NCCL's tree), so every rank ranks the chunks alike. Riding in the
    same message: ``extra`` (a flat fp32 vector: the trust ratio's noise sketches) and, when
    ``bounded`` (the payload goes over an fp16 wire), this rank's largest magnitude in the payload
    (``rows`` and the ``dense`` tail). The sum of the ranks' peaks bounds every partial and final sum
    of the payload, so the wire's shared power-of-two scale chosen from it cannot overflow and no
    separate max-allreduce is needed (``compression.Fp16Wire.sum_bounded``). ``weights`` ([chunks]):
    each rank's norms are multiplied by them before the sum (``comm.rank_by=raw``)."""
    norms = chunk_l1_norms(rows)
    if weights is not None:
        norms.mul_(weights)
    chunks = norms.numel()
    riders = [] if extra is None else [extra]  # what rides in the norms' small message
    if bounded:
        peak = peak_magnitude(rows)
        if dense is not None and dense.numel():
            peak = torch.maximum(peak, peak_magnitude(dense))
        riders.append(peak)
    if riders:
        norms = torch.cat([norms, *riders])
    norm_sum(norms, stats)  # every rank now ranks chunks by the same global norms
    return Agreed(norms[:chunks], norms[-1:] if bounded else None,
                  None if extra is None else norms[chunks:chunks + extra.numel()])


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


def hold_back(chosen_rows: torch.Tensor, residual: torch.Tensor, chosen: torch.Tensor, cap: float) -> torch.Tensor:
    """The release cap (ours, not the paper's). Scale each of ``chosen_rows`` (residual + this step's
    addition, about to be sent) down to at most ``cap`` times the L2 norm of this step's addition
    (``chosen_rows`` minus the ``chosen`` rows of ``residual``), in place; return what was held back
    (this thread's scratch buffer, valid until the next call), which stays in the residual.

    Why: a chunk that waited k steps holds k steps of updates (up to 1/(1 - m) times more under
    momentum correction), which DGC's rule sends at once when it is chosen; such bursts made the
    digits recipe's evaluations fall (docs/notes/2026-12-01-release-cap.md). What is held back is
    still counted in the chunk's norm, so the chunk is likely chosen again and the burst lands over
    several steps.
    Nothing is dropped: held back + sent is the chunk, and every rank still sends the same chunks."""
    held = scratch("csc held back", chosen_rows.numel(), chosen_rows.dtype, chosen_rows.device).view_as(chosen_rows)
    torch.index_select(residual, 0, chosen, out=held)
    step_norms = torch.sub(chosen_rows, held, out=held).norm(dim=1, keepdim=True)  # this step's rows
    tiny = torch.finfo(chosen_rows.dtype).tiny
    share = (step_norms * cap / chosen_rows.norm(dim=1, keepdim=True).clamp_min(tiny)).clamp_(max=1.0)
    # a chunk this step added nothing to (a parameter without gradient or weight decay) is sent
    # whole: capped at 0 it would keep its residual, and its norm would keep it chosen, forever
    share = torch.where(step_norms > 0, share, 1.0)
    torch.mul(chosen_rows, 1.0 - share, out=held)
    chosen_rows.sub_(held)
    return held


def density_at(epoch: float, density: float, warmup_epochs: float, ramp_epochs: int) -> float:
    """The fraction of chunks sent in ``epoch``: 1 for the first ``warmup_epochs`` (dense warm-up),
    then, over ``ramp_epochs`` epochs, DGC's exponential sparsity warm-up (the k-th of R epochs sends
    density^(k/(R+1)): 0.56, 0.32, 0.18 for density 0.1 and R = 3), then ``density``."""
    if epoch < warmup_epochs:
        return 1.0
    ramp_epoch = math.floor(epoch - warmup_epochs) + 1
    if ramp_epoch <= ramp_epochs:
        return density ** (ramp_epoch / (ramp_epochs + 1))
    return density
