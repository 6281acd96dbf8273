"""The scaling model against published results, measured into data (``results/model_check.json``).

``check_document`` fits the model's free parameters (link efficiency per fabric, the overlap
slowdown, the per-step overhead per framework: ``scaling/calibration.py``) on the rows of
``scaling/published.py`` marked fitted and checks every row: reported, predicted, error in points,
within the goal or not (a verdict per row and one for the whole table), and the command that
projects it. Then the paper's projection as a band over its unknowns, the calibration terms added
one at a time, its time to train, each framework's per-step excess, why each test miss remains,
and (unless skipped) the backward readiness by FLOPs against a per-layer profile measured on this
machine's CPU. ``render/scaling.py`` (``model_check``) words it as ``results/model_check.md``;
``main`` is ``scripts/model_check.py``.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

from gradientflow_repro import variants
from gradientflow_repro.scaling import calibration as cal
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.published import FABRICS, INTRA_NODE, Published

log = logging.getLogger(__name__)

DENSE_WARMUP_EPOCHS = 5  # configs/experiment/alexnet_512gpu.yaml: optim.warmup_epochs; CSC is dense until then
GOAL_POINTS = 5  # every row within 5 points of efficiency (15% of a speedup where only a speedup is given)
READINESS_MODELS = (("alexnet", 16), ("vgg16", 2))  # (torchvision model, batch) measured on this CPU


def cli_command(row: Published, params: cal.Parameters) -> str:
    """``scripts/simulate_scaling.py`` options that project ``row`` with the fitted parameters."""
    setup = cal.setup(row, params)  # the row as the check prices it: the options say the same
    options = ["--model", row.model, "--image-size", str(row.image_size), "--gpus", str(row.gpus),
               "--gpus-per-node", str(row.gpus_per_node), "--link-gbps", f"{row.link_gbps or 100:g}",
               "--link-efficiency", f"{setup.link_efficiency:g}", "--intra-node-gbytes-s", f"{setup.intra_node_GBps:g}",
               "--latency-us", f"{row.latency_us:g}", "--images-per-gpu", str(row.images_per_gpu),
               "--single-gpu-images-s", f"{row.single_gpu_images_s:g}",
               "--overlap-slowdown", f"{setup.overlap_slowdown:g}",
               "--step-overhead-ms", f"{1e3 * setup.step_overhead_s:g}",
               "--strategy", row.strategy, *(["--nccl-algo", "Ring"] if row.ring_only else [])]
    return "python scripts/simulate_scaling.py " + " ".join(shlex.quote(o) for o in options)


def row_data(checked: cal.Checked, params: cal.Parameters) -> dict[str, Any]:
    """One checked row: its setup, reported and predicted efficiency, error and verdict."""
    row = checked.row
    return {"name": row.name, "source": row.source, "confidence": row.confidence, "model": row.model,
            "gpus": row.gpus, "base_gpus": row.base_gpus, "gpus_per_node": row.gpus_per_node, "fabric": row.fabric,
            "strategy": row.strategy, "ring_only": row.ring_only, "framework": row.framework,
            "subset": "fitted" if row.fitted else "test",
            "reported_efficiency": row.reported, "reported_speedup": row.reported_speedup,
            "predicted_efficiency": checked.predicted, "predicted_speedup": checked.predicted * row.gpus,
            "error_points": checked.error_points, "within_goal": checked.within_goal, "note": row.note,
            "command": cli_command(row, params)}


def readiness_rows(model_name: str, batch: int) -> list[tuple[int, float, float]]:
    """(elements, readiness by FLOPs, readiness measured on this CPU) per weight tensor of a
    torchvision model at 224 pixels, in backward order."""
    import torch

    from gradientflow_repro.scaling.profile import build_named_model, flop_profile, measure_profile, readiness_table

    torch.manual_seed(0)
    model = build_named_model(model_name, 1000, 224)
    images, labels = torch.randn(batch, 3, 224, 224), torch.randint(0, 1000, (batch,))
    measured = measure_profile(model, images, labels, repeats=3)
    by_flops = flop_profile(model_name, 224, batch, 100.0)
    return [(e, f, m) for e, f, m in readiness_table(by_flops, against=measured) if m is not None]


def excess(params: cal.Parameters, checked: Sequence[cal.Checked]) -> Optional[dict[str, Any]]:
    """The TF benchmarks' DGX-1 rows as time: each step's excess over the single-GPU step, reported
    and predicted, beside the bytes each model sends: why the overhead of a framework whose one
    process drives every GPU of the node (``calibration.ONE_PROCESS_PER_NODE``) grows with them."""
    rows = [c for c in checked if c.row.framework in cal.ONE_PROCESS_PER_NODE and c.row.base_gpus == 1]
    if not rows:
        return None
    out = []
    for c in sorted(rows, key=lambda c: (c.row.gpus, c.row.model)):
        predicted = replace(c.row, reported_efficiency=c.predicted, reported_speedup=None)
        out.append({"name": c.row.name, "fitted": c.row.fitted, "reported_s": cal.excess_s(c.row),
                    "predicted_s": cal.excess_s(predicted), "overhead_s": cal.step_overhead_s(c.row, params)})
    return {"gradient_bytes": {name: cal.row_profile(c.row).elements * 4
                               for name, c in {c.row.model: c for c in rows}.items()},
            "why_per_gpu": dict(cal.ONE_PROCESS_PER_NODE), "rows": out}


def miss_reasons(rows: Sequence[dict]) -> dict[str, str]:
    """Why each test row outside the goal still misses, from the table's own numbers and the sources:
    what the model would need, and why no term was added for it (a term is kept only when it is
    fitted on the fitted subset, improves the test subset and has a source). Row name -> reason."""
    by_name = {r["name"]: r for r in rows}

    def points(name: str, key: str) -> float:
        return 100 * by_name[name][key] if name in by_name else float("nan")

    def drop(small: str, large: str, key: str) -> float:
        return points(small, key) - points(large, key)

    alexnet4, alexnet8 = "TF benchmarks DGX-1 alexnet 4 GPUs", "TF benchmarks DGX-1 alexnet 8 GPUs"
    vgg128, vgg512 = "Horovod 2017 vgg16 128 GPUs roce25", "Horovod 2017 vgg16 512 GPUs roce25"
    reasons = {
        "DLE PyTorch": "single node, PyTorch DDP: its per-step overhead is fitted on one of these READMEs' "
        "rows (DGX A100 AMP, the shortest step) and stands for everything a step costs besides compute and "
        "communication (the framework, the optimizer and the host's input pipeline, which feeds 8 x 1,200-2,500 "
        "images/s where the single-GPU figure had the host to itself); the sources give no per-node input "
        "capacity to price that part on its own",
        "DLE TensorFlow DGX-2 AMP": "single node of 16 GPUs, Horovod with AMP: 16 x 1,300 images/s from one "
        "host's input pipeline; the same README's FP32 row on the DGX-2 is within 3.5 points and its AMP "
        "rows on 8-GPU systems within 2.5. The sources give no input capacity per node: no term was added",
        vgg512: f"the measured efficiency falls {drop(vgg128, vgg512, 'reported_efficiency'):.0f} points from "
        f"128 to 512 GPUs, the model's {drop(vgg128, vgg512, 'predicted_efficiency'):.1f}: a ring's bytes per "
        "link, 2(N-1)/N of the buffer, hardly grow, and the 2(N-1) latencies per fused buffer are priced. "
        "Inception-v3 and ResNet-101 at 512 GPUs are within 2 points, so the loss is VGG-16's (the most bytes "
        "per FLOP); the 512-GPU chart gives no single-GPU throughput or batch (Table A's assumed), nothing "
        "in the sources names a cost that grows this way",
        alexnet8: f"from 4 to 8 GPUs on one DGX-1 the measured efficiency falls "
        f"{drop(alexnet4, alexnet8, 'reported_efficiency'):.1f} points, the model's "
        f"{drop(alexnet4, alexnet8, 'predicted_efficiency'):.1f}. The step's excess over one GPU's is the same "
        "for AlexNet and VGG-16 at 4 and at 8 GPUs (the table above), so what grows is a cost per step, not "
        "per byte: the model prices it as host work per GPU that TF's one process drives, linear in the GPUs "
        "(one host's work per GPU, the sources' reason). The measured excess grows faster than linearly "
        "from 4 to 8 GPUs; a form chosen to match that would be fitted on the test rows, and no source "
        "names one",
        "Goyal 2017 ResNet-50 256 GPUs": "the 50 Gbit/s Ethernet link takes RoCE 25's fitted efficiency (1.0) "
        "as its prior, Gloo's halving-doubling is priced as NCCL's ring, and the single-GPU throughput is "
        "TensorFlow's P100 figure (Goyal et al. give none); a lower Ethernet efficiency would close it, but "
        "no fitted row measures that fabric",
        "the paper: open-source baseline 64 GPUs": "the system is not named; the model reaches 2.5x only with "
        "links of a few Gbit/s effective or milliseconds per message (`results/scaling.md`): parameter "
        "servers or TCP, which the model does not describe",
    }
    return {r["name"]: next((text for key, text in reasons.items() if r["name"].startswith(key)), "not examined")
            for r in rows if r["subset"] == "test" and not r["within_goal"]}


def time_to_train(params: cal.Parameters, test: Sequence[cal.Checked]) -> dict[str, float]:
    """The paper's 95 epochs from the central setup's step predictions: the steady state only, and
    with the dense warm-up epochs at the dense lazy step (``perfmodel.time_to_train``)."""
    paper_row = next(r.row for r in test if r.row.strategy == "gradientflow")
    profile, net = cal.row_profile(paper_row), cal.network(paper_row, params)
    step = pm.predict_step(profile, 512, net, cal.strategy(paper_row)).step_s
    dense_step = pm.predict_step(profile, 512, net, pm.strategy_of(variants.LAZY_FP16)).step_s
    batch = 512 * paper_row.images_per_gpu
    run = pm.time_to_train(pm.PAPER_EPOCHS, pm.IMAGENET_TRAIN, batch, step, DENSE_WARMUP_EPOCHS, dense_step)
    steady = pm.time_to_train(pm.PAPER_EPOCHS, pm.IMAGENET_TRAIN, batch, step)
    return {"steady": steady.total_s, "with_dense_warmup": run.total_s, "step_s": step, "dense_step_s": dense_step,
            "dense_warmup_epochs": DENSE_WARMUP_EPOCHS}


def check_document(command: str, measure: bool = True) -> dict[str, Any]:
    """Everything ``results/model_check.md`` says, as data (the module's steps)."""
    from gradientflow_repro.provenance import environment_facts

    params, _, fitted, test, _ = cal.calibrate()
    rows = [row_data(c, params) for c in fitted + test]
    test_rms = cal.rms_points(test)
    horovod = params.step_overhead_s.get("horovod", 0.0)
    readiness = {name: readiness_rows(name, batch) for name, batch in READINESS_MODELS} if measure else {}
    return {
        "command": command, "environment": environment_facts(),
        "parameters": {"link_efficiency": params.link_efficiency, "intra_efficiency": params.intra_efficiency,
                       "overlap_slowdown": params.overlap_slowdown, "step_overhead_s": params.step_overhead_s},
        "free": [f"{kind} {key}".strip() for kind, key in cal.FREE], "priors": dict(cal.PRIORS),
        "fabrics": dict(FABRICS), "intra_node_GBps": {k: v[0] for k, v in INTRA_NODE.items()},
        "one_process_per_node": sorted(cal.ONE_PROCESS_PER_NODE), "ib56_efficiency": params.link("ib56"),
        "fit_rms_points": cal.rms_points(fitted), "test_rms_points": test_rms, "fitted_rows": len(fitted),
        "test_rows": len(test), "goal_points": GOAL_POINTS,
        "goal_met": all(r["within_goal"] for r in rows),
        "rows_outside_goal": [r["name"] for r in rows if not r["within_goal"]],
        "error_signs": sorted({"+" if r["error_points"] > 0 else "-" for r in rows}),
        "rows": rows,
        "paper_unknowns": {"gpus_per_node": list(cal.PAPER_GPUS_PER_NODE), "single_gpu": dict(cal.PAPER_SINGLE_GPU)},
        "paper_band": cal.paper_band(params, test_rms), "paper_speedup": pm.PAPER_SPEEDUP,
        "decomposition": [{"model": what, "speedup": value}
                          for what, value in cal.paper_decomposition(params, horovod)],
        "time_to_train_s": time_to_train(params, test),
        "excess": excess(params, fitted + test), "miss_reasons": miss_reasons(rows),
        "readiness": readiness}


def main(argv: Optional[Sequence[str]] = None, command: str = "python scripts/model_check.py") -> Path:
    """``scripts/model_check.py``: the check as data (``--report``: the committed
    ``results/model_check.json``; else under ``results/runs/model_check/``; ``--out``: a path without
    suffix), its Markdown rendered beside it. Returns the Markdown's path."""
    from gradientflow_repro import render

    parser = argparse.ArgumentParser(prog="model_check.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", action="store_true", help="rewrite the committed results/model_check.md, .json")
    parser.add_argument("--out", type=Path, default=None, help="path without suffix (instead of --report's place)")
    parser.add_argument("--no-measure", action="store_true", help="skip the CPU readiness profile (slow)")
    args = parser.parse_args(argv)
    if args.report and args.out is not None:
        parser.error("--report writes results/model_check; it takes no --out")
    out = args.out or render.output_dir("model_check", args.report) / "model_check"
    document = check_document(command, not args.no_measure)
    data = render.write_data(out.with_suffix(".json"), "scaling.model_check", document)
    markdown = render.render_file(data)
    log.info("%s", markdown.read_text())
    log.info("written: %s and %s", render.shown(markdown), render.shown(data))
    return markdown
