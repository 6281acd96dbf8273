#!/usr/bin/env python3
"""The scaling model for any cluster: speedup per strategy against GPU count, as data, Markdown and a plot.

With no options: the paper's setting (AlexNet-BN at 224, 128 images per GPU, 56 Gbit/s, 8 GPUs per
node; each value's source in gradientflow_repro/scaling/paper.py), the speedup of every strategy
for 1 to 512 GPUs, the checks against the paper's 410.2x and 2.5x, and the sensitivity of the full
stack. Every input is an option, so another cluster can be set against the model without editing
code, e.g. ResNet-50 at 256 images per GPU on 100 Gbit/s with 4 GPUs per node, to 2048 GPUs:

    python scripts/simulate_scaling.py --model resnet50 --images-per-gpu 256 --single-gpu-images-s 1200 \\
        --link-gbps 100 --gpus-per-node 4 --gpus 8,64,352,1024,2048 --strategy allreduce,ddp,gradientflow

The terms fitted on published results (results/model_check.json: the fabric's link efficiency, the
overlap slowdown, the framework's per-step overhead; --fabric, --framework) apply by default, each
printed with its source; an option sets any of them, --uncalibrated gives the ceiling (nominal
links, free overlap, no overhead). E.g. Horovod's ResNet-101 on 64 GPUs of 40 Gbit/s TCP:

    python scripts/simulate_scaling.py --model resnet101 --gpus 64 --gpus-per-node 4 --link-gbps 40 \\
        --fabric tcp40 --framework horovod --latency-us 30 --images-per-gpu 64 --single-gpu-images-s 136 \\
        --strategy 'ddp-style bucketed builtin' --nccl-algo Ring

The projection is written as data (.json), Markdown rendered from it (.md) and a plot (.png) under
results/runs/scaling/NAME (--name; --out for another place outside the committed results/); --report
rewrites the committed results/scaling (`make bench` does). The models whose FLOP counts ship
(gradientflow_repro/scaling/profiles/) are projected without importing torch; any other torchvision
or timm model is counted first (torch). A bad option is one line on stderr and exit status 2,
before any work. The logic: gradientflow_repro/scaling/cli.py and projection.py.
"""

from __future__ import annotations

from typing import Optional

from gradientflow_repro import logs, render
from gradientflow_repro.scaling import cli
from gradientflow_repro.scaling.cli import build_parser, check, setup_of  # noqa: F401 - the options, for tests

REPORT = render.output_dir(cli.NAME, True) / cli.NAME  # the committed report: only --report writes it
RUNS = render.output_dir(cli.NAME, False)  # where a projection goes unless told


def main(argv: Optional[list[str]] = None) -> None:
    logs.configure("simulate_scaling")
    cli.main(argv, RUNS, REPORT, __doc__)


if __name__ == "__main__":
    main()
