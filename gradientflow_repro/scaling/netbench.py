"""The network as the ring and the backend see it: per-message latency, link bandwidth, the
backend's own allreduce by message size, and one allreduce per gradient of a model.

``measure_network`` launches the ranks (``cluster.launch.run_ranks``, in the emulated network or on
loopback) ``launches`` times and averages what rank 0 wrote. Each rank runs this module:

    python -m gradientflow_repro.scaling.netbench OUT.json TENSORS.json    # RANK, WORLD_SIZE, MASTER_* set

and joins the group through ``cluster.world.run_rank`` (``env://``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from gradientflow_repro.cluster import netemu
from gradientflow_repro.cluster.launch import run_ranks

if TYPE_CHECKING:
    from gradientflow_repro.scaling import perfmodel as pm

MODULE = ("-m", "gradientflow_repro.scaling.netbench")
LARGE_BYTES = 8 << 20  # the ring's bandwidth is taken from an allreduce of this size


def measure_network(world: int, net: Optional[netemu.EmulatedNetwork], run_dir: Path,
                    timeout_s: float, tensor_elements: Sequence[int] = (), launches: int = 3) -> dict:
    """Per-message latency and link bandwidth as the ring sees them, the same for the backend's
    own allreduce, and (given the model's gradient sizes) how long one allreduce per gradient takes
    in isolation, by either. Each figure is the mean over ``launches`` separate launches of the
    ranks (rank 0 writes one JSON per launch): on a shared host the per-message costs differ more
    between launches than between the calls of one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tensors.json").write_text(json.dumps(list(tensor_elements)))
    measured = []
    for launch in range(launches):
        out = run_dir / f"network{launch + 1}.json"
        run_ranks(world, [str(out), str(run_dir / "tensors.json")], run_dir, "netbench", net, timeout_s,
                  show=False, module=MODULE)
        measured.append(json.loads(out.read_text()))
    mean = {key: (None if value is None else
                  [[row[0], statistics.mean(m[key][i][1] for m in measured)] for i, row in enumerate(value)]
                  if isinstance(value, list) else statistics.mean(m[key] for m in measured))
            for key, value in measured[0].items()}
    size = mean.pop("ring_large_bytes")
    figures = ring_figures(mean["tiny_ring_s"], mean["ring_large_s"], world, size)
    return {**mean, "latency_s": figures["latency_s"], "bandwidth_Bps": figures["bandwidth_Bps"], "launches": launches,
            "burst_bytes": net.burst_payload_bytes if net else 0.0}  # the shaper's, as configured


def priced_network(measured: dict) -> "pm.Network":
    """``perfmodel.Network`` from ``measure_network``'s figures (``cluster_check.model_network`` reads
    the cluster benchmark's, which describe nodes)."""
    from gradientflow_repro.scaling import perfmodel as pm

    table = measured.get("builtin_cost_by_size")
    return pm.Network(measured["bandwidth_Bps"], measured["latency_s"],
                      tiny_allreduce_s=measured.get("tiny_allreduce_s"), burst_bytes=measured.get("burst_bytes", 0.0),
                      builtin_cost_by_size=tuple(map(tuple, table)) if table else None)


def small_message_kb(world: int, measured: dict) -> int:
    """``comm.small_message_kb`` for this network: the switch-over between recursive doubling and the
    (flat) ring that the model prices on the figures just measured (``perfmodel.switch_over_bytes``),
    in KiB, at least 1 and at most the default (``knobs.SMALL_MESSAGE_BYTES``, measured on loopback,
    whose latency x bandwidth is far above a shaped link's: with it a CSC payload of a few hundred KB
    went by recursive doubling, sending log2(N)/(2(N-1)/N) = 4/3 as many bytes at four ranks as the
    ring). At two ranks the model never prefers the ring (the same bytes in twice the steps); the
    cap keeps large messages on the ring there, so a `ring` rung still sends by the ring."""
    from gradientflow_repro.comm.knobs import SMALL_MESSAGE_BYTES
    from gradientflow_repro.scaling.perfmodel import switch_over_bytes

    return max(1, min(switch_over_bytes(world, priced_network(measured), "ring"), SMALL_MESSAGE_BYTES) // 1024)


def ring_figures(tiny_s: float, large_s: float, ranks: int, large_bytes: int = LARGE_BYTES) -> dict[str, float]:
    """Per-message latency and bandwidth of a ring of ``ranks`` from a one-element-per-rank and a
    ``large_bytes`` allreduce: tiny = 2(n-1) a; large = 2(n-1) (a + S / (n B))."""
    latency = tiny_s / (2 * (ranks - 1))
    bandwidth = 2 * (ranks - 1) / ranks * large_bytes / max(1e-9, large_s - 2 * (ranks - 1) * latency)
    return {"tiny_s": tiny_s, "large_s": large_s, "latency_s": latency, "bandwidth_Bps": bandwidth}


def trimmed_mean(values: Sequence[float]) -> float:
    """The mean without the lowest and highest tenth (at least one each, from three values on)."""
    ordered = sorted(values)
    cut = max(1, len(ordered) // 10) if len(ordered) >= 3 else 0
    kept = ordered[cut:len(ordered) - cut]
    return sum(kept) / len(kept)


def _measure(rank: int, world: int, out: Path, tensors_file: Path) -> None:
    """One rank's share of the measurement; rank 0 writes the figures to ``out``."""
    import torch
    import torch.distributed as dist

    from gradientflow_repro.comm.base import CommStats
    from gradientflow_repro.comm.factory import build_sum
    from gradientflow_repro.comm.recursive_doubling import small_sum
    from gradientflow_repro.comm.ring import ring_allreduce_

    def timed(tensor: object, calls: int, allreduce: Callable = ring_allreduce_, back_to_back: bool = False) -> float:
        """Mean seconds per call, without the fastest and slowest tenth: a training step pays the
        sum of many calls, and small ones are bimodal when ranks share cores (a rank that is not
        running answers a scheduler slice later), so the median would miss what they cost. Each
        call starts after a barrier, or ``back_to_back`` as a training step issues them (and as
        nccl-tests times them): then a call also pays for the ranks it waits for."""
        allreduce(tensor)
        times = []
        for _ in range(calls):
            if not back_to_back:
                dist.barrier()
            started = time.perf_counter()
            allreduce(tensor)
            times.append(time.perf_counter() - started)
        return trimmed_mean(times)

    tiny = timed(torch.ones(world), 30)  # one element per rank: latency only
    # a one-value MAX allreduce, as the fp16 wire's shared scale (recursive doubling: small_sum)
    scale_max = small_sum(op="max")
    scale_max_s = timed(torch.ones(1), 30, lambda t: scale_max(t, CommStats()))
    size = LARGE_BYTES
    large = timed(torch.ones(size // 4), 15)  # per call bimodal on a shaped link: the mean of several calls
    # the backend's own allreduce (the `allreduce` and `ddp` strategies), which need not be a ring:
    # its cost by message size, one element per rank up to past DDP's 25 MiB buckets, back to back
    # as `allreduce` issues one per gradient. Small sizes are dense in the table: with two or more
    # elements per rank gloo's small allreduce takes several times as long as with one.
    builtin_sizes = [4 * world, 64, 256, 1024] + [4096 * 4 ** k for k in range(7)] + [32 << 20]
    builtin_cost = [[nbytes, timed(torch.ones(nbytes // 4), 20 if nbytes < 1 << 20 else 10 if nbytes <= size else 5,
                                   dist.all_reduce, back_to_back=True)] for nbytes in sorted(set(builtin_sizes))]
    # one allreduce per gradient of the model, back to back: what `allreduce`, `ring` and
    # `ring`+fp16 do after backward, without the training around it
    gradients = [torch.randn(n) for n in json.loads(tensors_file.read_text())]
    # as the `ring` strategies build them with the default switch-over: small tensors by recursive
    # doubling, the rest by the ring (the runs use the one set from these figures, ``small_message_kb``)
    ring, ring_fp16 = build_sum("ring", "fp32"), build_sum("ring", "fp16")
    per_tensor = {name: timed(gradients, 5, lambda tensors, fn=fn: [fn(t) for t in tensors]) if gradients else None
                  for name, fn in (("builtin", dist.all_reduce), ("ring", lambda t: ring(t, CommStats())),
                                   ("ring_fp16", lambda t: ring_fp16(t, CommStats())))}
    if rank == 0:
        out.write_text(json.dumps({
            "tiny_allreduce_s": scale_max_s, "tiny_ring_s": tiny, "ring_large_s": large, "ring_large_bytes": size,
            "builtin_cost_by_size": builtin_cost, "per_tensor_builtin_s": per_tensor["builtin"],
            "per_tensor_ring_s": per_tensor["ring"], "per_tensor_ring_fp16_s": per_tensor["ring_fp16"]}))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """A rank of the measurement, as ``run_ranks`` starts it: ``OUT.json TENSORS.json``."""
    from gradientflow_repro.cluster.world import run_rank

    out, tensors_file = (Path(a) for a in (sys.argv[1:] if argv is None else argv))
    run_rank(_measure, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", out, tensors_file,
             timeout_s=120)


if __name__ == "__main__":
    main()
