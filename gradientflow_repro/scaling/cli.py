"""``scripts/simulate_scaling.py``: the scaling model for any cluster from the command line.

The options name a model, its GPU and a cluster (``projection.Setup``); each is checked before any
work (a bad one is one line on stderr and exit status 2). The terms that published results fit
(``scaling/calibration.py``: the fabric's link efficiency, the overlap slowdown, the framework's
per-step overhead) are taken by default from the committed calibration, each logged with its
source; an option sets any of them, and ``--uncalibrated`` sets the nominal ones (1, 0, 0: the
ceiling set by communication alone). For the paper's own setup the projection judges its goals on
the calibrated model itself (``projection.calibrated``) and carries the paper's calibrated band.

The projection goes to data (``.json``), its Markdown rendered from it (``render/scaling.py``) and
its figure (``.png``): under ``results/runs/scaling/`` unless ``--report`` (the committed
``results/scaling``) or ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn, Optional, Sequence

from gradientflow_repro import render
from gradientflow_repro.scaling import calibration
from gradientflow_repro.scaling.profile import SHIPPED, model_name_error, shipped_flops
from gradientflow_repro.scaling.projection import (
    DEFAULT_STRATEGIES,
    GPU_COUNTS,
    Setup,
    parse_strategies,
    strategy_options,
    write_scaling,
)
from gradientflow_repro.scaling.published import FABRICS

log = logging.getLogger(__name__)

NAME = "scaling"  # results/scaling with --report, else results/runs/scaling/
# The fitted terms at their nominal values (the ceiling): (what, ``Setup`` field, value)
NOMINAL = (("link efficiency", "link_efficiency", 1.0), ("overlap slowdown", "overlap_slowdown", 0.0),
           ("framework overhead per step", "step_overhead_s", 0.0))


def _shown(option: str, value: float) -> str:
    return f"{value * 1e3:g} ms" if option == "step_overhead_s" else f"{value:g}"


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


def build_parser(description: str = __doc__, runs: Path = render.RUNS / NAME,
                 report: Path = render.RESULTS / NAME) -> Parser:
    default = Setup()
    shipped = ", ".join(f"{name} ({size} px)" for name, size in SHIPPED)
    frameworks = ", ".join(sorted((calibration.committed() or {}).get("parameters", {}).get("step_overhead_s", {})))
    parser = Parser(prog="simulate_scaling.py", description=description,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
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
    model.add_argument("--framework", default=None,
                       help=f"whose fitted per-step overhead applies ({frameworks or 'none fitted yet'}); "
                            "default: none")
    model.add_argument("--step-overhead-ms", type=float, default=None,
                       help="a framework's overhead per step on more than one GPU (ModelProfile.step_overhead_s); "
                       "where one process drives a node's GPUs, all of it at these GPUs "
                       "(calibration.step_overhead_s); default: --framework's fitted one")
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpus", type=gpu_counts, default=GPU_COUNTS, metavar="N,N,...",
                         help=f"GPU counts to project (default: {','.join(map(str, GPU_COUNTS))})")
    cluster.add_argument("--link-gbps", type=float, default=default.link_gbps, help="each node's network link")
    cluster.add_argument("--fabric", choices=sorted(k for k in FABRICS if k != "none"), default=None,
                         help="the links' kind, whose fitted efficiency applies (default: the one fabric of "
                              "scaling/published.py at --link-gbps, if one)")
    cluster.add_argument("--link-efficiency", type=float, default=None,
                         help="fraction of the link's rate a ring reaches, in (0, 1] (Network.link_efficiency); "
                              "default: the fabric's fitted one")
    cluster.add_argument("--gpus-per-node", type=int, default=default.gpus_per_node)
    cluster.add_argument("--intra-node-gbytes-s", type=float, default=default.intra_node_GBps,
                         help="GB/s between GPUs of a node (PCIe 3.0 x16: 10; NVLink: 100 and more)")
    cluster.add_argument("--latency-us", type=float, default=default.latency_us, help="per message")
    cluster.add_argument("--backend", choices=("nccl", "gloo"), default="nccl" if default.nccl else "gloo",
                         help="nccl (default): NCCL's allreduce sums unless a strategy asks for ours; gloo: ours")
    cluster.add_argument("--nccl-algo", choices=("Ring",), default=None,
                         help="NCCL_ALGO in the job's environment (Ring: NCCL's ring alone); default: its tuner")
    cluster.add_argument("--overlap-slowdown", type=float, default=None,
                         help="seconds backward loses per second of communication it overlaps, at least 0 "
                              "(Network.overlap_slowdown); default: the fitted one")
    cluster.add_argument("--local-work-slowdown", type=float, default=default.local_work_slowdown,
                         help="seconds backward loses per second of local work (CSC's, the fp16 wire's, "
                              "PowerSGD's) it overlaps, at least 0; default: as --overlap-slowdown; 1: none of "
                              "it hidden (Network.local_work_slowdown)")
    cluster.add_argument("--uncalibrated", action="store_true",
                         help="nominal links, free overlap, no framework overhead: the ceiling set by communication "
                              "alone (options still set any of them)")
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
                        help=f"the files' name under {render.shown(runs)}/ (default: the model and image size)")
    output.add_argument("--out", type=Path, default=None,
                        help="path without suffix, instead of --name (not in the committed results/)")
    output.add_argument("--report", action="store_true",
                        help=f"rewrite the committed {render.shown(report)}.md, .json and .png (make bench)")
    return parser


def check(args: argparse.Namespace, report: Path = render.RESULTS / NAME) -> Optional[str]:
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
                f"use --report to rewrite {render.shown(report)}.md")
    fitted = (calibration.committed() or {}).get("parameters", {}).get("step_overhead_s", {})
    if args.framework is not None and args.framework not in fitted:
        return f"--framework {args.framework!r}: no overhead fitted for it (fitted: {', '.join(sorted(fitted))})"
    return model_name_error(args.model)


def _committed(out: Path) -> bool:
    """Whether ``out`` lies in results/ but not in results/runs/ (where the committed reports are)."""
    path = out.resolve()
    return path.is_relative_to(render.RESULTS) and not path.is_relative_to(render.RUNS)


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


def setup_of(args: argparse.Namespace, image_size: int) -> Setup:
    """The projection's setup that checked options ask for, with the fitted terms they set (the
    others nominal: ``calibrated_setup`` takes them from the calibration)."""
    chosen = tuple(dict.fromkeys(label for group in args.strategy for label in group)) if args.strategy else None
    return Setup(model=args.model, image_size=image_size, images_per_gpu=args.images_per_gpu,
                 single_gpu_images_s=args.single_gpu_images_s, link_gbps=args.link_gbps,
                 gpus_per_node=args.gpus_per_node, intra_node_GBps=args.intra_node_gbytes_s,
                 latency_us=args.latency_us, gpu_memory_GBps=args.gpu_memory_gbytes_s,
                 num_classes=args.num_classes, strategies=chosen or DEFAULT_STRATEGIES,
                 nccl=args.backend == "nccl", nccl_algo=args.nccl_algo, bucket_mb=args.bucket_mb, density=args.density,
                 link_efficiency=1.0 if args.link_efficiency is None else args.link_efficiency,
                 overlap_slowdown=args.overlap_slowdown or 0.0, local_work_slowdown=args.local_work_slowdown,
                 step_overhead_s=(args.step_overhead_ms or 0.0) * 1e-3)


def calibrated_setup(args: argparse.Namespace, setup: Setup) -> tuple[Setup, list[dict]]:
    """``setup`` with each fitted term the options leave unset taken from the committed calibration
    (``calibration.terms``: the fabric's link efficiency, the overlap slowdown, the framework's
    overhead), and the terms as they apply, each with its source. Nominal under ``--uncalibrated`` or
    where no calibration is written. The paper's own setup stays as it is: its projection judges its
    goals on the calibration itself (``projection.calibrated``), with the same values."""
    fabric = args.fabric or calibration.fabric_of(args.link_gbps)
    found = None if args.uncalibrated else calibration.terms(fabric, args.framework, args.gpus_per_node)
    given = {"link_efficiency": args.link_efficiency, "overlap_slowdown": args.overlap_slowdown,
             "step_overhead_s": None if args.step_overhead_ms is None else args.step_overhead_ms * 1e-3}
    if found is None:
        why = "nominal, as asked: the ceiling" if args.uncalibrated else "nominal: no calibration is written"
        found = [{"term": term, "option": option, "value": value, "shown": _shown(option, value), "source": why}
                 for term, option, value in NOMINAL]
    terms = [dict(term, value=given[term["option"]], shown=_shown(term["option"], given[term["option"]]),
                  source="the command line") if given[term["option"]] is not None else term for term in found]
    if setup.is_paper or args.uncalibrated:
        return setup, terms
    return replace(setup, **{term["option"]: term["value"] for term in terms}), terms


def main(argv: Optional[Sequence[str]] = None, runs: Path = render.RUNS / NAME, report: Path = render.RESULTS / NAME,
         description: str = __doc__) -> None:
    """Parse and check the options, project, write the data, its Markdown and its figure."""
    parser = build_parser(description, runs, report)
    args = parser.parse_args(argv)
    error = check(args, report)
    if error:
        parser.error(error)
    image_size = image_size_for(args.model, args.image_size)
    if shipped_flops(args.model, image_size, args.num_classes) is None and not _importable("torch"):
        parser.error(f"no FLOP counts ship for {args.model} at {image_size} pixels and {args.num_classes} "
                     f"classes, and counting them needs torch, which cannot be imported")
    setup, terms = calibrated_setup(args, setup_of(args, image_size))
    out = report if args.report else args.out or runs / (args.name or f"{args.model}-{image_size}")
    if not args.report and _committed(out):  # a --name that climbs out of results/runs/
        parser.error(f"{render.shown(out)}: results/ outside results/runs/ holds committed reports; use --report")
    for term in terms:
        log.info("%s: %s (%s)", term["term"], term["shown"], term["source"])
    command = "python scripts/simulate_scaling.py" + "".join(
        f" {_quote(a)}" for a in (sys.argv[1:] if argv is None else argv))
    band = calibration.band_section() if setup.is_paper and not args.uncalibrated else None
    try:
        text = write_scaling(out, setup, command, args.gpus, band, terms, calibrate=not args.uncalibrated)
    except ValueError as error:  # what the checks above cannot foresee: say so, no traceback
        sys.exit(f"{parser.prog}: error: {error}")
    except ImportError as error:  # a size that ships no counts, on a machine without torch
        sys.exit(f"{parser.prog}: error: no FLOP counts ship for {args.model} at {image_size} pixels, and "
                 f"counting them needs torch ({error})")
    log.info("%s", text)
    log.info("written: %s, .json and .png", render.shown(out.with_suffix(".md")))


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
