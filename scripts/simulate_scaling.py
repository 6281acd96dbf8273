#!/usr/bin/env python3
"""The scaling model for any cluster: speedup per strategy against GPU count, as Markdown and a plot.

With no options: the paper's setting (AlexNet-BN at 224, 128 images per GPU, 56 Gbit/s, 8 GPUs per
node; each value's source in gradientflow_repro/scaling/perfmodel.py), the speedup of every strategy
for 1 to 512 GPUs, the checks against the paper's 410.2x and 2.5x, and the sensitivity of the full
stack. Every input is an option, so another cluster can be set against the model without editing
code, e.g. ResNet-50 at 256 images per GPU on 100 Gbit/s with 4 GPUs per node, to 2048 GPUs:

    python scripts/simulate_scaling.py --model resnet50 --images-per-gpu 256 --single-gpu-images-s 1200 \\
        --link-gbps 100 --gpus-per-node 4 --gpus 8,64,352,1024,2048 --strategy allreduce,ddp,gradientflow

The report is printed and written to results/runs/scaling/NAME.md and .png (--name; --out for
another place outside the committed results/); --report rewrites the committed results/scaling.md
(`make bench` does). The models whose FLOP counts ship (gradientflow_repro/scaling/profiles/) are
projected without importing torch; any other torchvision or timm model is counted first (torch).
A bad option is one line on stderr and exit status 2, before any work.

The logic: gradientflow_repro/scaling/projection.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import sys
from pathlib import Path
from typing import NoReturn, Optional

from gradientflow_repro import REPO
from gradientflow_repro.scaling.profile import SHIPPED, model_name_error, shipped_flops
from gradientflow_repro.scaling.projection import (
    DEFAULT_STRATEGIES,
    GPU_COUNTS,
    Setup,
    parse_strategies,
    strategy_options,
    write_scaling,
)

REPORT = REPO / "results" / "scaling"  # the committed report: only --report writes it
RUNS = REPO / "results" / "runs" / "scaling"  # where a projection goes unless told


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def gpu_counts(value: str) -> tuple[int, ...]:
    """``8,64,352``: GPU counts, each at least 1, in increasing order."""
    try:
        counts = tuple(sorted({int(part) for part in value.split(",") if part.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of whole numbers") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: every GPU count must be at least 1")
    return counts


def strategies(value: str) -> tuple[str, ...]:
    try:
        return parse_strategies(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> Parser:
    default = Setup()
    shipped = ", ".join(f"{name} ({size} px)" for name, size in SHIPPED)
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model and GPU")
    model.add_argument("--model", default=default.model,
                       help=f"shipped, no torch needed: {shipped}; or any torchvision or timm model name")
    model.add_argument("--image-size", type=int, default=None,
                       help="pixels (default: the shipped size of a shipped model, else 224)")
    model.add_argument("--images-per-gpu", type=int, default=default.images_per_gpu)
    model.add_argument("--single-gpu-images-s", type=float, default=default.single_gpu_images_s,
                       help="training throughput of one GPU (default: the paper's, derived from its abstract)")
    model.add_argument("--num-classes", type=int, default=default.num_classes)
    model.add_argument("--gpu-memory-gbytes-s", type=float, default=default.gpu_memory_GBps,
                       help="prices CSC's and the fp16 wire's local work; 0: free")
    model.add_argument("--step-overhead-ms", type=float, default=default.step_overhead_s * 1e3,
                       help="a framework's overhead per step on more than one GPU (ModelProfile.step_overhead_s); "
                       "where one process drives a node's GPUs, all of it at these GPUs "
                       "(calibration.step_overhead_s)")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=gpu_counts, default=GPU_COUNTS, metavar="N,N,...",
                         help=f"GPU counts to project (default: {','.join(map(str, GPU_COUNTS))})")
    cluster.add_argument("--link-gbps", type=float, default=default.link_gbps, help="each node's network link")
    cluster.add_argument("--link-efficiency", type=float, default=default.link_efficiency,
                         help="fraction of the link's rate a ring reaches, in (0, 1] (Network.link_efficiency)")
    cluster.add_argument("--gpus-per-node", type=int, default=default.gpus_per_node)
    cluster.add_argument("--intra-node-gbytes-s", type=float, default=default.intra_node_GBps,
                         help="GB/s between GPUs of a node (PCIe 3.0 x16: 10; NVLink: 100 and more)")
    cluster.add_argument("--latency-us", type=float, default=default.latency_us, help="per message")
    cluster.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if default.nccl else "gloo",
                         help="nccl (default): NCCL's allreduce sums unless a strategy asks for ours; gloo: ours")
    cluster.add_argument("--nccl-algo", choices=("Ring",), default=None,
                         help="NCCL_ALGO in the job's environment (Ring: NCCL's ring alone); default: its tuner")
    cluster.add_argument("--overlap-slowdown", type=float, default=default.overlap_slowdown,
                         help="seconds backward loses per second of communication it overlaps, at least 0 "
                              "(Network.overlap_slowdown)")
    cluster.add_argument("--local-work-slowdown", type=float, default=default.local_work_slowdown,
                         help="seconds backward loses per second of local work (CSC's, the fp16 wire's, "
                              "PowerSGD's) it overlaps, at least 0; default: as --overlap-slowdown; 1: none of "
                              "it hidden (Network.local_work_slowdown)")
    strategy = parser.add_argument_group("strategies")
    strategy.add_argument("--strategy", action="append", type=strategies, metavar="NAME[,NAME...]",
                          help=f"registered labels, repeated or comma-separated; default: "
                               f"{', '.join(DEFAULT_STRATEGIES)}; allowed: {'; '.join(strategy_options())}")
    strategy.add_argument("--bucket-mb", type=float, default=None,
                          help="pool part (DDP: bucket) size of every fused strategy (default: each preset's)")
    strategy.add_argument("--density", type=float, default=None,
                          help="density of every sparse strategy, in (0, 1] (default: each preset's)")
    output = parser.add_argument_group("output")
    output.add_argument("--name", default=None,
                        help=f"the files' name under {shown(RUNS)}/ (default: the model and image size)")
    output.add_argument("--out", type=Path, default=None,
                        help="path without suffix, instead of --name (not in the committed results/)")
    output.add_argument("--report", action="store_true",
                        help=f"rewrite the committed {shown(REPORT)}.md and .png (make bench)")
    return parser


def shown(path: Path) -> str:
    """``path`` relative to the checkout where it is inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else path)


def check(args: argparse.Namespace) -> Optional[str]:
    """The first thing wrong with the options, in one line; None when all are usable."""
    for name in ("image_size", "images_per_gpu", "gpus_per_node", "num_classes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be at least 1, not {value}"
    for name in ("single_gpu_images_s", "link_gbps", "intra_node_gbytes_s", "latency_us"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}"
    for name in ("gpu_memory_gbytes_s", "overlap_slowdown", "step_overhead_ms", "local_work_slowdown"):
        if getattr(args, name) is not None and not getattr(args, name) >= 0:
            return f"--{name.replace('_', '-')} must be at least 0, not {getattr(args, name)}"
    for name in ("link_efficiency", "density"):
        value = getattr(args, name)
        if value is not None and not 0 < value <= 1:
            return f"--{name.replace('_', '-')} must be in (0, 1], not {value}"
    if args.bucket_mb is not None and not args.bucket_mb > 0:
        return f"--bucket-mb must be positive, not {args.bucket_mb}"
    if args.gpus_per_node > max(args.gpus):
        return (f"--gpus-per-node {args.gpus_per_node} is larger than the largest GPU count asked for "
                f"({max(args.gpus)}): no count would fill one node")
    if args.report and (args.out is not None or args.name is not None):
        return "--report writes results/scaling; it takes neither --out nor --name"
    if args.out is not None and _committed(args.out):
        return (f"--out {args.out}: results/ outside results/runs/ holds committed reports; "
                f"use --report to rewrite {shown(REPORT)}.md")
    return model_name_error(args.model)


def _committed(out: Path) -> bool:
    """Whether ``out`` lies in results/ but not in results/runs/ (where the committed reports are)."""
    path = out.resolve()
    results = REPO / "results"
    return path.is_relative_to(results) and not path.is_relative_to(results / "runs")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def image_size_for(model: str, asked: Optional[int]) -> int:
    """The image size asked for, else the shipped one of a model that ships at one size, else 224."""
    if asked is not None:
        return asked
    sizes = {size for name, size in SHIPPED if name == model}
    return sizes.pop() if len(sizes) == 1 else Setup().image_size


def band_sections() -> list[str]:
    """The paper's calibrated band (``calibration.band_section``: Markdown lines, read from what
    scripts/model_check.py wrote; none before it has run)."""
    from gradientflow_repro.scaling import calibration

    return list(calibration.band_section())


def setup_of(args: argparse.Namespace, image_size: int) -> Setup:
    """The projection's setup that checked options ask for."""
    chosen = tuple(dict.fromkeys(label for group in args.strategy for label in group)) if args.strategy else None
    return Setup(model=args.model, image_size=image_size, images_per_gpu=args.images_per_gpu,
                 single_gpu_images_s=args.single_gpu_images_s, link_gbps=args.link_gbps,
                 gpus_per_node=args.gpus_per_node, intra_node_GBps=args.intra_node_gbytes_s,
                 latency_us=args.latency_us, gpu_memory_GBps=args.gpu_memory_gbytes_s,
                 num_classes=args.num_classes, strategies=chosen or DEFAULT_STRATEGIES,
                 nccl=args.backend == "nccl", nccl_algo=args.nccl_algo, bucket_mb=args.bucket_mb, density=args.density,
                 link_efficiency=args.link_efficiency, overlap_slowdown=args.overlap_slowdown,
                 local_work_slowdown=args.local_work_slowdown, step_overhead_s=args.step_overhead_ms * 1e-3)


def main(argv: Optional[list[str]] = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    error = check(args)
    if error:
        parser.error(error)
    image_size = image_size_for(args.model, args.image_size)
    if shipped_flops(args.model, image_size, args.num_classes) is None and not _importable("torch"):
        parser.error(f"no FLOP counts ship for {args.model} at {image_size} pixels and {args.num_classes} "
                     f"classes, and counting them needs torch, which cannot be imported")
    setup = setup_of(args, image_size)
    out = REPORT if args.report else args.out or RUNS / (args.name or f"{args.model}-{image_size}")
    if not args.report and _committed(out):  # a --name that climbs out of results/runs/
        parser.error(f"{shown(out)}: results/ outside results/runs/ holds committed reports; use --report")
    command = "python scripts/simulate_scaling.py" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv))
    sections = band_sections() if setup.is_paper else []  # the band is the paper's setup's
    try:
        print(write_scaling(out, setup, command, args.gpus, sections))
    except ValueError as error:  # what the checks above cannot foresee: say so, no traceback
        sys.exit(f"{parser.prog}: error: {error}")
    except ImportError as error:  # a size that ships no counts, on a machine without torch
        sys.exit(f"{parser.prog}: error: no FLOP counts ship for {args.model} at {image_size} pixels, and "
                 f"counting them needs torch ({error})")
    print(f"written: {shown(out.with_suffix('.md'))} and .png")


if __name__ == "__main__":
    main()
