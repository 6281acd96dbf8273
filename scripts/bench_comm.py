#!/usr/bin/env python3
"""Communication strategies on real gradient shapes -> results/comm.md

For torchvision's AlexNet and ResNet-50 (their gradient shapes do not depend on the input size:
both end in an adaptive pool, so a small random input gives the real 61M / 25.6M-parameter
gradients at a fraction of the compute), each strategy runs real steps (forward, backward,
``synchronize()``) in ``--world`` gloo processes. Reported per step: seconds the trainer waited in
``synchronize()``, the whole step, bytes this rank sent and collectives issued. CSC is measured in
its sparse phase (after warm-up).

    python scripts/bench_comm.py [--world 4] [--steps 3] [--models alexnet resnet50]
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gradientflow_repro.comm import build_communicator  # noqa: E402
from gradientflow_repro.distributed import destroy_process_group_and_exit  # noqa: E402
from gradientflow_repro.models import build_model  # noqa: E402
from gradientflow_repro.tracking import environment_facts  # noqa: E402

CONFIGS: list[tuple[str, dict]] = [
    ("allreduce (per tensor)", {"strategy": "allreduce"}),
    *[(f"lazy {mb} MB, overlap {'on' if overlap else 'off'}",
       {"strategy": "lazy", "algorithm": "builtin", "bucket_mb": mb, "overlap": overlap})
      for mb in (1, 8, 32, 128) for overlap in (True, False)],
    ("ddp (25 MB buckets)", {"strategy": "ddp"}),
    *[(f"csc density {d}", {"strategy": "csc", "algorithm": "builtin", "density": d,
                            "csc_warmup_epochs": 0.0, "bucket_mb": 32}) for d in (1.0, 0.1, 0.01)],
]


def _worker(rank: int, world: int, port: int, models: list[str], steps: int, image: int,
            out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=900))
    rows = []
    for model_name in models:
        for label, options in CONFIGS:
            torch.manual_seed(0)
            model = build_model(model_name, 1000, image)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.0, momentum=0.9)
            comm = build_communicator(options, torch.device("cpu"))
            train_model = comm.attach(model, optimizer)
            x = torch.randn(2, 3, image, image, generator=torch.Generator().manual_seed(rank))
            y = torch.randint(1000, (2,), generator=torch.Generator().manual_seed(rank))
            waits, totals, sent, collectives = [], [], [], []
            for step in range(steps + 1):
                comm.begin_step(epoch=10.0)
                dist.barrier()
                started = time.perf_counter()
                torch.nn.functional.cross_entropy(train_model(x), y).backward()
                comm.synchronize()
                total = time.perf_counter() - started
                comm.end_step(True)
                stats = comm.stats.take()
                optimizer.zero_grad(set_to_none=True)
                if step > 0:  # the first step builds buckets and warms caches
                    waits.append(stats["wait_s"])
                    totals.append(total)
                    sent.append(stats["bytes"])
                    collectives.append(stats["collectives"])
            comm.close()
            params = sum(p.numel() for p in model.parameters())
            rows.append({"model": model_name, "params": params, "config": label,
                         "wait_s": statistics.median(waits), "step_s": statistics.median(totals),
                         "bytes": statistics.median(sent), "collectives": statistics.median(collectives)})
            if rank == 0:
                print(f"{model_name:9s} {label:28s} wait {rows[-1]['wait_s']:.3f}s step "
                      f"{rows[-1]['step_s']:.3f}s {rows[-1]['bytes'] / 2**20:8.1f} MiB "
                      f"{rows[-1]['collectives']:.0f} collectives", flush=True)
            del model, train_model, comm
    if rank == 0:
        torch.save(rows, Path(out) / "comm_rows.pt")
    destroy_process_group_and_exit()  # skips finalization: see its docstring


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--models", nargs="+", default=["alexnet", "resnet50"])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "comm.md")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_worker, args=(args.world, port, args.models, args.steps, args.image,
                                      str(args.out.parent)), nprocs=args.world, join=True,
                       start_method="spawn")
    rows = torch.load(args.out.parent / "comm_rows.pt")
    (args.out.parent / "comm_rows.pt").unlink()
    facts = environment_facts()
    command = "python scripts/bench_comm.py " + " ".join(sys.argv[1:])
    lines = ["# Communication strategies on AlexNet and ResNet-50 gradients", "",
             f"Machine: {facts['cpu']}, {facts['cpu_count']} cores, no GPU; {args.world} gloo ranks on "
             f"this machine (loopback, no network emulation). torch {facts['torch']}, commit "
             f"{facts['git_commit']}.",
             f"Command: `{command}`. Batch 2 of {args.image}x{args.image} random images per rank (the "
             f"gradient shapes are the real ones); medians of {args.steps} steps after one warm-up step. "
             "Bytes: what this rank sent (ring-equivalent 2(N-1)/N of the payload for builtin collectives).",
             ""]
    goals = []
    for model in args.models:
        subset = [r for r in rows if r["model"] == model]
        dense = next(r for r in subset if r["config"] == "allreduce (per tensor)")
        lines += [f"## {model} ({subset[0]['params'] / 1e6:.1f}M parameters, "
                  f"{subset[0]['params'] * 4 / 2**20:.0f} MiB of fp32 gradients)", "",
                  "| strategy | wait in synchronize (s/step) | step (s) | MiB sent/step | of dense | collectives/step |",
                  "|---|---|---|---|---|---|"]
        for r in subset:
            lines.append(f"| {r['config']} | {r['wait_s']:.3f} | {r['step_s']:.3f} | {r['bytes'] / 2**20:.1f} "
                         f"| {100 * r['bytes'] / dense['bytes']:.1f}% | {r['collectives']:.0f} |")
        lines.append("")
        if model == "resnet50":
            best = min((r for r in subset if r["config"].startswith("lazy") and "overlap on" in r["config"]),
                       key=lambda r: r["wait_s"])
            goals.append(f"lazy with overlap waits at most half as long as per-tensor allreduce on ResNet-50: "
                         f"{best['config']} waits {best['wait_s']:.3f}s vs {dense['wait_s']:.3f}s "
                         f"({best['wait_s'] / dense['wait_s']:.2f}x): "
                         f"{'met' if best['wait_s'] <= dense['wait_s'] / 2 else 'NOT met'}")
        csc = next(r for r in subset if r["config"] == "csc density 0.1")
        goals.append(f"csc at density 0.1 puts at most 12% of the dense bytes on the wire ({model}): "
                     f"{100 * csc['bytes'] / dense['bytes']:.1f}%: "
                     f"{'met' if csc['bytes'] <= 0.12 * dense['bytes'] else 'NOT met'}")
    lines += ["## Goals", ""] + [f"- {g}" for g in goals] + [""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
