"""Communication strategies on real gradient shapes -> results/comm.md

For torchvision's AlexNet and ResNet-50 (their gradient shapes do not depend on the input size:
both end in an adaptive pool, so a small random input gives the real 61M / 25.6M-parameter
gradients at a fraction of the compute), each strategy runs real steps (forward, backward,
``synchronize()``) in ``world`` gloo processes (``cluster.world.spawn``). Reported per step: seconds
the trainer waited in ``synchronize()``, the whole step, bytes this rank sent and collectives
issued. CSC is measured in its sparse phase (after warm-up).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from gradientflow_repro.cluster.world import spawn
from gradientflow_repro.comm import build_communicator, registry
from gradientflow_repro.models import build_model
from gradientflow_repro.provenance import environment_facts


def configs() -> list[tuple[str, dict]]:
    """(label, ``comm.*`` options) of every strategy measured: the registry's ``COMM_BENCH`` list
    (per-tensor allreduce, the pool's part size with and without overlap, DDP, CSC's density, and
    PyTorch's own fp16 and PowerSGD hooks beside them)."""
    return list(registry.options_of(registry.COMM_BENCH).items())


def _measure(rank: int, world: int, models: list[str], steps: int, image: int, out: str) -> None:
    """One rank's steps of every model and strategy; rank 0 saves the rows to ``out/comm_rows.pt``."""
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
            if rank == 0:
                print(f"{model_name:9s} {label:28s} wait {rows[-1]['wait_s']:.3f}s step "
                      f"{rows[-1]['step_s']:.3f}s {rows[-1]['bytes'] / 2**20:8.1f} MiB "
                      f"{rows[-1]['collectives']:.0f} collectives", flush=True)
            del model, train_model, comm
    if rank == 0:
        torch.save(rows, Path(out) / "comm_rows.pt")


def bench_comm(out: Path, world: int = 4, steps: int = 3, image: int = 64,
               models: Sequence[str] = ("alexnet", "resnet50"), command: str = "python scripts/bench_comm.py") -> str:
    """Measure every strategy of ``configs()`` on every model and write ``out``; returns the Markdown."""
    models = list(models)
    out.parent.mkdir(parents=True, exist_ok=True)
    spawn(_measure, world, models, steps, image, str(out.parent), timeout_s=900)
    rows = torch.load(out.parent / "comm_rows.pt", weights_only=True)
    (out.parent / "comm_rows.pt").unlink()
    facts = environment_facts()
    lines = ["# Communication strategies on AlexNet and ResNet-50 gradients", "",
             f"Machine: {facts['cpu']}, {facts['cpu_count']} cores, no GPU; {world} gloo ranks on "
             f"this machine (loopback, no network emulation). torch {facts['torch']}, commit "
             f"{facts['git_commit']}.",
             f"Command: `{command}`. Batch 2 of {image}x{image} random images per rank (the "
             f"gradient shapes are the real ones); medians of {steps} steps after one warm-up step "
             "(PowerSGD: after the steps it sends whole, `Communicator.steps_sent_whole`). "
             "Bytes: what this rank sent (ring-equivalent 2(N-1)/N of the payload for builtin collectives). "
             "DDP and its hooks (`ddp`, `ddp-fp16`, `powersgd`) reduce inside backward, so they wait "
             "nothing in `synchronize()`: compare steps.",
             ""]
    goals = []
    for model in models:
        subset = [r for r in rows if r["model"] == model]
        dense = next(r for r in subset if r["options"] == {"strategy": "allreduce"})  # per-tensor allreduce
        lines += [f"## {model} ({subset[0]['params'] / 1e6:.1f}M parameters, "
                  f"{subset[0]['params'] * 4 / 2**20:.0f} MiB of fp32 gradients)", "",
                  "| strategy | wait in synchronize (s/step) | step (s) | MiB sent/step | of dense "
                  "| collectives/step |",
                  "|---|---|---|---|---|---|"]
        for r in subset:
            lines.append(f"| {r['config']} | {r['wait_s']:.3f} | {r['step_s']:.3f} | {r['bytes'] / 2**20:.1f} "
                         f"| {100 * r['bytes'] / dense['bytes']:.1f}% | {r['collectives']:.0f} |")
        lines.append("")
        if model == "resnet50":
            best = min((r for r in subset if r["options"]["strategy"] == "lazy" and r["options"].get("overlap")),
                       key=lambda r: r["wait_s"])
            goals.append(f"lazy with overlap waits at most half as long as per-tensor allreduce on ResNet-50: "
                         f"{best['config']} waits {best['wait_s']:.3f}s vs {dense['wait_s']:.3f}s "
                         f"({best['wait_s'] / dense['wait_s']:.2f}x): "
                         f"{'met' if best['wait_s'] <= dense['wait_s'] / 2 else 'NOT met'}")
        csc = next(r for r in subset if r["options"]["strategy"] == "csc" and r["options"].get("density") == 0.1)
        goals.append(f"csc at density 0.1 puts at most 12% of the dense bytes on the wire ({model}): "
                     f"{100 * csc['bytes'] / dense['bytes']:.1f}%: "
                     f"{'met' if csc['bytes'] <= 0.12 * dense['bytes'] else 'NOT met'}")
    lines += ["## Goals", ""] + [f"- {g}" for g in goals] + [""]
    text = "\n".join(lines)
    out.write_text(text)
    return text
