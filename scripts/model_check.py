#!/usr/bin/env python3
"""The scaling model against published results -> results/model_check.md, .json

Fits the model's free parameters (link efficiency per fabric, the overlap slowdown, the per-step
overhead per framework: ``gradientflow_repro/scaling/calibration.py``) on the rows of
``gradientflow_repro/scaling/published.py`` marked fitted, and checks every row: reported,
predicted, error in points, fitted or test, and the command that projects it. Then the paper's
projection as a band over its unknowns, its time to train, and the backward readiness by FLOPs
against a per-layer profile measured on this machine's CPU.

    python scripts/model_check.py [--out results/model_check] [--no-measure]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from gradientflow_repro import REPO
from gradientflow_repro.comm import registry
from gradientflow_repro.scaling import calibration as cal
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.published import FABRICS, INTRA_NODE, Published

DENSE_WARMUP_EPOCHS = 5  # configs/experiment/alexnet_512gpu.yaml: optim.warmup_epochs; CSC is dense until then


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


def _row(checked: cal.Checked, params: cal.Parameters) -> dict:
    row = checked.row
    return {"name": row.name, "source": row.source, "confidence": row.confidence, "model": row.model,
            "gpus": row.gpus, "base_gpus": row.base_gpus, "gpus_per_node": row.gpus_per_node, "fabric": row.fabric,
            "strategy": row.strategy, "ring_only": row.ring_only, "framework": row.framework,
            "subset": "fitted" if row.fitted else "test",
            "reported_efficiency": row.reported, "reported_speedup": row.reported_speedup,
            "predicted_efficiency": checked.predicted, "predicted_speedup": checked.predicted * row.gpus,
            "error_points": checked.error_points, "within_goal": checked.within_goal, "note": row.note,
            "command": cli_command(row, params)}


def _table(rows: list[dict]) -> list[str]:
    lines = ["| setup | source | reported | predicted | error (points) | within goal | subset |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = (f" ({r['reported_speedup']:g}x)" if r["reported_speedup"] else "")
        predicted = f" ({r['predicted_speedup']:.1f}x)" if r["reported_speedup"] else ""
        ring = ", ring-only" if r["ring_only"] else ""
        lines.append(f"| {r['name']} (`{r['strategy']}`{ring}) | {r['source']} [{r['confidence']}] "
                     f"| {100 * r['reported_efficiency']:.1f}%{speed} "
                     f"| {100 * r['predicted_efficiency']:.1f}%{predicted} | {r['error_points']:+.1f} "
                     f"| {'yes' if r['within_goal'] else 'NO'} | {r['subset']} |")
    return lines


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


def excess_section(params: cal.Parameters, checked: list[cal.Checked]) -> list[str]:
    """The TF benchmarks' DGX-1 rows as time: each step's excess over the single-GPU step, reported
    and predicted, beside the bytes each model sends: why the overhead of a framework whose one
    process drives every GPU of the node (``calibration.ONE_PROCESS_PER_NODE``) grows with them."""
    rows = [c for c in checked if c.row.framework in cal.ONE_PROCESS_PER_NODE and c.row.base_gpus == 1]
    if not rows:
        return []
    lines = ["## Per-step excess of one process driving a node's GPUs", "",
             "TF's replicated benchmarks on one DGX-1 (`calibration.excess_s`): how much longer each step is than "
             "the single-GPU step (images per GPU fixed), as reported and as predicted, and the modelled framework "
             "overhead within the predicted one (`calibration.step_overhead_s`). Gradient bytes per step: "
             + ", ".join(f"{name} {cal.row_profile(c.row).elements * 4 / 1e6:,.0f} MB"
                         for name, c in {c.row.model: c for c in rows}.items()) + ". Why per GPU: "
             + "; ".join(f"{k}: {why}" for k, why in cal.ONE_PROCESS_PER_NODE.items()) + ".", "",
             "| setup | fitted | reported excess (ms) | predicted excess (ms) | of it, framework overhead (ms) |",
             "|---|---|---|---|---|"]
    for c in sorted(rows, key=lambda c: (c.row.gpus, c.row.model)):
        predicted = replace(c.row, reported_efficiency=c.predicted, reported_speedup=None)
        lines.append(f"| {c.row.name} | {'yes' if c.row.fitted else 'no'} | {1e3 * cal.excess_s(c.row):.1f} "
                     f"| {1e3 * cal.excess_s(predicted):.1f} | {1e3 * cal.step_overhead_s(c.row, params):.1f} |")
    return lines


def why_misses(rows: list[dict]) -> list[str]:
    """Why each test row outside the goal still misses, from the table's own numbers and the sources:
    what the model would need, and why no term was added for it (a term is kept only when it is
    fitted on the fitted subset, improves the test subset and has a source). Markdown lines."""
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
    misses = [r for r in rows if r["subset"] == "test" and not r["within_goal"]]
    lines = ["## Why the test misses remain", "",
             "Each is over-predicted; for each, what the table shows and why no further term was added (a term "
             "is kept only if fitted on the fitted subset, it improves the test subset and a source names it):", ""]
    for r in misses:
        reason = next((text for key, text in reasons.items() if r["name"].startswith(key)), "not examined")
        lines.append(f"- {r['name']} ({r['error_points']:+.1f} points): {reason}.")
    return lines if misses else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "results" / "model_check", help="path without suffix")
    parser.add_argument("--no-measure", action="store_true", help="skip the CPU readiness profile (slow)")
    args = parser.parse_args()
    command = "python scripts/model_check.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])

    params, rms, fitted, test, _ = cal.calibrate()
    rows = [_row(c, params) for c in fitted + test]
    band = cal.paper_band(params, cal.rms_points(test))

    from gradientflow_repro.provenance import environment_facts

    facts = environment_facts()
    free = ", ".join(f"{kind} {key}".strip() for kind, key in cal.FREE)
    fit_lines = ["- link efficiency: " + ", ".join(f"{k} ({FABRICS[k]}) {v:.3f}" for k, v in
                                                   sorted(params.link_efficiency.items())),
                 "- intra-node efficiency: " + ", ".join(f"{k} {v:.3f} of {INTRA_NODE[k][0]:g} GB/s"
                                                         for k, v in sorted(params.intra_efficiency.items())),
                 f"- overlap slowdown: {params.overlap_slowdown:.3f}",
                 "- step overhead: " + ", ".join(
                     f"{k} {1e3 * v:.1f} ms" + (" per GPU beyond the first that its one process drives"
                                                if k in cal.ONE_PROCESS_PER_NODE else "")
                     for k, v in sorted(params.step_overhead_s.items())),
                 f"- priors for fabrics no fitted row measures: {cal.PRIORS} (ib56: NCCL's maintainers' 96%)"]
    outside = [r["name"] for r in rows if not r["within_goal"]]
    signs = {("+" if r["error_points"] > 0 else "-") for r in rows}
    lines = ["# The scaling model against published results", "",
             f"Command: `{command}`; commit {facts.get('git_commit', 'unknown')}; machine: {facts.get('cpu')} "
             f"({facts.get('cpu_count')} cores), {facts.get('platform')}, torch {facts.get('torch')}. The model is "
             "analytic: no machine's speed enters the table; the readiness section below is measured on this CPU.",
             "", "Sources and setups: `gradientflow_repro/scaling/published.py` (each row's note names what is "
             "assumed). Confidence: H the source's own table or text, M a secondary source.", "",
             f"## Fit (least squares by coordinate descent on grids; free: {free})", "",
             f"Fitted on {len(fitted)} rows, RMS error {cal.rms_points(fitted):.1f} points; test on {len(test)} rows, "
             f"RMS error {cal.rms_points(test):.1f} points. Goal: every row within 5 points (15% of a speedup "
             f"where only a speedup is given): {'met' if not outside else f'NOT met by {len(outside)} rows'}; "
             f"errors of sign {', '.join(sorted(signs))}.", "", *fit_lines, "",
             "## Fitted subset", "", *_table([r for r in rows if r["subset"] == "fitted"]), "",
             "## Test subset", "", *_table([r for r in rows if r["subset"] == "test"]), "",
             "Commands that project each row (the options of `scripts/simulate_scaling.py`):", ""]
    lines += [f"- {r['name']}: `{r['command']}`" for r in rows]
    lines += ["", "Rows marked ring-only were fitted and checked on NCCL's ring alone (the 2017 systems' flat ring); "
              "the command line prices NCCL's faster of ring and tree, which differs only where latency dominates."]

    lines += ["", "## The paper's projection with its spread", "",
              f"Function `calibration.paper_band`. Unknowns: GPUs per node {cal.PAPER_GPUS_PER_NODE}, single-GPU "
              f"AlexNet throughput {', '.join(f'{k} {v:,.0f}' for k, v in cal.PAPER_SINGLE_GPU.items())} images/s, "
              f"framework overhead 0 or Horovod's fitted; the local work (CSC's, the fp16 wire's, PowerSGD's) "
              f"hidden by backward as communication is, or not at all (`Network.local_work_slowdown` 1: no "
              f"published row has local work to fit it on); 56 Gbit/s at efficiency {params.link('ib56'):.2f}; the "
              f"band widened by the test RMS ({cal.rms_points(test):.1f} points).", "",
              "| strategy | GPUs | paper | central | band |", "|---|---|---|---|---|"]
    for label, entry in band.items():  # the full stack, dense lazy, DDP and PyTorch's hooks, the baseline
        reported = f"{entry['reported']:g}x" if entry["reported"] else "-"
        lines.append(f"| `{label}` | {entry['gpus']} | {reported} | {entry['central']:.1f}x "
                     f"| {entry['low']:.1f}x - {entry['high']:.1f}x |")
    horovod = params.step_overhead_s.get("horovod", 0.0)
    decomposition = cal.paper_decomposition(params, horovod)
    lines += ["", "Which part of 410.2x the full stack reaches, term by term (`calibration.paper_decomposition`; "
              "central setup: 8 GPUs per node, the paper's implied single-GPU throughput, PCIe inside a node):", "",
              "| model | `gradientflow` at 512 GPUs | of 410.2x |", "|---|---|---|"]
    lines += [f"| {what} | {value:.1f}x | {value / pm.PAPER_SPEEDUP:.2f} |" for what, value in decomposition]
    lines += ["", "Every combination:", "",
              "| strategy | GPUs per node | GPU | overhead (ms) | local work hidden | speedup |",
              "|---|---|---|---|---|---|"]
    for label, entry in band.items():
        lines += [f"| `{label}` | {g['gpus_per_node']} | {g['gpu']} | {1e3 * g['overhead_s']:.1f} "
                  f"| {'as communication' if g.get('local_work_slowdown') is None else 'no'} "
                  f"| {g['speedup']:.1f}x |" for g in entry["grid"]]

    # time to train: the paper's 1.5 minutes, from the central setup's step predictions
    paper_row = next(r.row for r in test if r.row.strategy == "gradientflow")
    profile = cal.row_profile(paper_row)
    net = cal.network(paper_row, params)
    step = pm.predict_step(profile, 512, net, cal.strategy(paper_row)).step_s
    dense_step = pm.predict_step(profile, 512, net, pm.strategy_of(registry.LAZY_FP16)).step_s
    run = pm.time_to_train(pm.PAPER_EPOCHS, pm.IMAGENET_TRAIN, 512 * paper_row.images_per_gpu, step,
                           DENSE_WARMUP_EPOCHS, dense_step)
    steady = pm.time_to_train(pm.PAPER_EPOCHS, pm.IMAGENET_TRAIN, 512 * paper_row.images_per_gpu, step)
    lines += ["", "## Time to train (the paper: 95 epochs in 1.5 minutes)", "",
              f"`perfmodel.time_to_train`, central setup: steady state only {steady.total_s / 60:.2f} min; with "
              f"{DENSE_WARMUP_EPOCHS} dense warm-up epochs at the dense lazy step ({dense_step * 1e3:.1f} ms against "
              f"{step * 1e3:.1f} ms) {run.total_s / 60:.2f} min; evaluation and start-up not known (0 here), each "
              "adds to it. The paper's 1.5 min is the comparison."]

    lines += ["", *excess_section(params, fitted + test)]
    lines += ["", *why_misses(rows)]

    readiness: dict[str, list] = {}
    if not args.no_measure:
        for name, batch in (("alexnet", 16), ("vgg16", 2)):
            readiness[name] = readiness_rows(name, batch)
        lines += ["", "## Backward readiness: FLOPs against a per-layer profile measured on this CPU", "",
                  "Fraction of backward done when each weight's gradient is complete (torchvision models at 224; "
                  "measured: `profile.measure_profile`, medians of 3 steps, batch 16 for AlexNet and 2 for VGG-16, "
                  "this machine's CPU).", "",
                  "| model | weight elements | by FLOPs | measured on CPU | difference (points) |",
                  "|---|---|---|---|---|"]
        for name, table in readiness.items():
            lines += [f"| {name} | {e:,} | {100 * f:.1f}% | {100 * m:.1f}% | {100 * (m - f):+.1f} |"
                      for e, f, m in table]
        largest = {name: max(table) for name, table in readiness.items()}
        lines += ["", "The largest gradient (the first fully connected layer) is ready "
                  + "; ".join(f"{name}: {100 * f:.1f}% into backward by FLOPs, {100 * m:.1f}% measured"
                              for name, (_, f, m) in largest.items())
                  + ". FLOPs leave out memory-bound work (ReLU, pooling, dropout, the weight gradients' own "
                  "memory traffic), a larger share of a CPU's backward than of a GPU's, so a GPU lies between the "
                  "two columns; FLOP readiness is the end that favours overlap. Only a GPU profile can say where: "
                  "none is measured here."]
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({
        "command": command, "environment": facts, "parameters": {
            "link_efficiency": params.link_efficiency, "intra_efficiency": params.intra_efficiency,
            "overlap_slowdown": params.overlap_slowdown, "step_overhead_s": params.step_overhead_s},
        "fit_rms_points": cal.rms_points(fitted), "test_rms_points": cal.rms_points(test), "rows": rows,
        "paper_band": band, "time_to_train_s": {"steady": steady.total_s, "with_dense_warmup": run.total_s},
        "readiness": readiness}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
