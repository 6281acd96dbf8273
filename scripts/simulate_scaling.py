#!/usr/bin/env python3
"""The scaling model for any published setup -> results/scaling.md, .png

With no options: the paper's setting (AlexNet-BN at 224, 128 images per GPU, 56 Gbit/s, 8 GPUs per
node; each value's source in gradientflow_repro/scaling/perfmodel.py), the speedup of every strategy for 1
to 512 GPUs, the checks against the paper's 410.2x and 2.5x, and the sensitivity of the full stack.
Every input is an option, so another paper's cluster can be set against the model without editing
code, e.g. ResNet-50 at 256 images per GPU on 100 Gbit/s with 4 GPUs per node:

    python scripts/simulate_scaling.py --model resnet50 --images-per-gpu 256 --single-gpu-images-s 1200 \\
        --link-gbps 100 --gpus-per-node 4 --out results/scaling_resnet50

The logic: gradientflow_repro/scaling/projection.py.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from gradientflow_repro import REPO
from gradientflow_repro.scaling.projection import DEFAULT_STRATEGIES, Setup, strategy_options, write_scaling


def main() -> None:
    default = Setup()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=default.model,
                        help="ours (alexnet_bn, alexnet, resnet50), a torchvision or a timm model name")
    parser.add_argument("--image-size", type=int, default=default.image_size, help="pixels (our models)")
    parser.add_argument("--images-per-gpu", type=int, default=default.images_per_gpu)
    parser.add_argument("--single-gpu-images-s", type=float, default=default.single_gpu_images_s,
                        help="training throughput of one GPU (default: the paper's, derived from its abstract)")
    parser.add_argument("--link-gbps", type=float, default=default.link_gbps, help="each node's network link")
    parser.add_argument("--gpus-per-node", type=int, default=default.gpus_per_node)
    parser.add_argument("--intra-node-gbytes-s", type=float, default=default.intra_node_GBps,
                        help="GB/s between GPUs of a node (PCIe 3.0 x16: 10; NVLink: 100 and more)")
    parser.add_argument("--latency-us", type=float, default=default.latency_us, help="per message")
    parser.add_argument("--gpu-memory-gbytes-s", type=float, default=default.gpu_memory_GBps,
                        help="prices CSC's and the fp16 wire's local work; 0: free")
    parser.add_argument("--num-classes", type=int, default=default.num_classes)
    parser.add_argument("--strategy", action="append", choices=list(strategy_options()), metavar="NAME",
                        help=f"repeat for several; default: {', '.join(DEFAULT_STRATEGIES)}; allowed: "
                             f"{', '.join(strategy_options())}")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "scaling", help="path without suffix")
    args = parser.parse_args()
    for name in ("image_size", "images_per_gpu", "gpus_per_node", "num_classes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("single_gpu_images_s", "link_gbps", "intra_node_gbytes_s", "latency_us"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.gpu_memory_gbytes_s < 0:
        parser.error("--gpu-memory-gbytes-s must be at least 0 (0: local work is free)")
    setup = Setup(model=args.model, image_size=args.image_size, images_per_gpu=args.images_per_gpu,
                  single_gpu_images_s=args.single_gpu_images_s, link_gbps=args.link_gbps,
                  gpus_per_node=args.gpus_per_node, intra_node_GBps=args.intra_node_gbytes_s,
                  latency_us=args.latency_us, gpu_memory_GBps=args.gpu_memory_gbytes_s,
                  num_classes=args.num_classes, strategies=tuple(args.strategy or DEFAULT_STRATEGIES))
    command = "python scripts/simulate_scaling.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    try:
        print(write_scaling(args.out, setup, command))
    except ValueError as error:  # an unknown model name: say so, no traceback
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
