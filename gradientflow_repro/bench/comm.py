"""Communication strategies on real gradient shapes -> results/comm.json, rendered to results/comm.md

For torchvision's AlexNet and ResNet-50 (their gradient shapes do not depend on the input size:
both end in an adaptive pool, so a small random input gives the real 61M / 25.6M-parameter
gradients at a fraction of the compute), each strategy runs real steps (forward, backward,
``synchronize()``) in ``world`` gloo processes (``cluster.world.spawn``). Reported per step: seconds
the trainer waited in ``synchronize()``, the whole step, bytes this rank sent and collectives
issued. CSC is measured in its sparse phase (after warm-up).
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from gradientflow_repro import logs, render, variants
from gradientflow_repro.bench import lineup, provenance
from gradientflow_repro.cluster.world import spawn
from gradientflow_repro.comm import build_communicator
from gradientflow_repro.models import build_model

log = logging.getLogger(__name__)
KIND = "bench.comm"
LAZY_WAIT_LIMIT = 0.5  # lazy with overlap waits at most half as long as per-tensor allreduce (ResNet-50)
CSC_BYTES_LIMIT = 0.12  # CSC at density 0.1 sends at most 12% of the dense bytes


def configs() -> list[tuple[str, dict]]:
    """(label, ``comm.*`` options) of every strategy measured: ``lineup.comm_bench``
    (per-tensor allreduce, the pool's part size with and without overlap, DDP, CSC's density, and
    PyTorch's own fp16 and PowerSGD hooks beside them)."""
    return list(variants.options_of(lineup.comm_bench()).items())


def _measure(rank: int, world: int, models: list[str], steps: int, image: int, out: str) -> None:
    """One rank's steps of every model and strategy; rank 0 saves the rows to ``out/comm_rows.pt``."""
    logs.configure("bench_comm", rank)
    rows = []
    for model_name in models:
        for label, options in configs():
            torch.manual_seed(0)
            model = build_model(model_name, 1000, image)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
            comm = build_communicator(options, torch.device("cpu"))
            train_model = comm.attach(model, optimizer)
            x = torch.randn(2, 3, image, image, generator=torch.Generator().manual_seed(rank))
            y = torch.randint(1000, (2,), generator=torch.Generator().manual_seed(rank))
            waits, totals, sent, collectives = [], [], [], []
            # the first step builds buckets and warms caches; a strategy that sends its first steps
            # whole (PowerSGD) is timed from its first compressed one
            warmup = max(1, comm.steps_sent_whole)
            for step in range(warmup + steps):
                comm.begin_step(epoch=10.0)
                dist.barrier()
                started = time.perf_counter()
                torch.nn.functional.cross_entropy(train_model(x), y).backward()
                comm.synchronize()
                total = time.perf_counter() - started
                comm.end_step(True)
                stats = comm.stats.take()
                optimizer.zero_grad(set_to_none=True)
                if step >= warmup:
                    waits.append(stats["wait_s"])
                    totals.append(total)
                    sent.append(stats["bytes"])
                    collectives.append(stats["collectives"])
            comm.close()
            params = sum(p.numel() for p in model.parameters())
            rows.append({"model": model_name, "params": params, "config": label, "options": options,
                         "wait_s": statistics.median(waits), "step_s": statistics.median(totals),
                         "bytes": statistics.median(sent), "collectives": statistics.median(collectives)})
            log.info(f"{model_name:9s} {label:28s} wait {rows[-1]['wait_s']:.3f}s step "
                     f"{rows[-1]['step_s']:.3f}s {rows[-1]['bytes'] / 2**20:8.1f} MiB "
                     f"{rows[-1]['collectives']:.0f} collectives")
            del model, train_model, comm
    if rank == 0:
        torch.save(rows, Path(out) / "comm_rows.pt")


def bench_comm(out: Path, world: int = 4, steps: int = 3, image: int = 64,
               models: Sequence[str] = ("alexnet", "resnet50"), command: str = "python scripts/bench_comm.py") -> str:
    """Measure every strategy of ``configs()`` on every model; write the rows and the goals'
    verdicts beside ``out`` (.json, kind ``bench.comm``) and the Markdown rendered from them to
    ``out``; returns the Markdown."""
    models = list(models)
    out.parent.mkdir(parents=True, exist_ok=True)
    spawn(_measure, world, models, steps, image, str(out.parent), timeout_s=900)
    rows = torch.load(out.parent / "comm_rows.pt", weights_only=True)
    (out.parent / "comm_rows.pt").unlink()
    document = {"provenance": provenance(command, world), "world": world, "steps": steps, "image": image,
                "models": [], "goals": []}
    for model in models:
        subset = [r for r in rows if r["model"] == model]
        dense = next(r for r in subset if r["options"] == {"strategy": "allreduce"})  # per-tensor allreduce
        document["models"].append({"model": model, "params": subset[0]["params"], "rows": [
            {**r, "of_dense": r["bytes"] / dense["bytes"]} for r in subset]})
        if model == "resnet50":
            best = min((r for r in subset if r["options"]["strategy"] == "lazy" and r["options"].get("overlap")),
                       key=lambda r: r["wait_s"])
            document["goals"].append({"goal": "lazy_wait", "model": model, "config": best["config"],
                                      "wait_s": best["wait_s"], "dense_wait_s": dense["wait_s"],
                                      "ratio": best["wait_s"] / dense["wait_s"], "limit": LAZY_WAIT_LIMIT,
                                      "met": best["wait_s"] <= LAZY_WAIT_LIMIT * dense["wait_s"]})
        csc = next(r for r in subset if r["options"]["strategy"] == "csc" and r["options"].get("density") == 0.1)
        document["goals"].append({"goal": "csc_bytes", "model": model, "density": 0.1,
                                  "share": csc["bytes"] / dense["bytes"], "limit": CSC_BYTES_LIMIT,
                                  "met": csc["bytes"] <= CSC_BYTES_LIMIT * dense["bytes"]})
    data = render.write_data(out.with_suffix(".json"), KIND, document)
    return render.render_file(data, out).read_text()
