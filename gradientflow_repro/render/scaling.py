"""The scaling model's Markdown: the projection (``results/scaling.md``, from ``scaling/projection.py``'s
data) and the model against published results (``results/model_check.md``, from
``scaling/published_check.py``'s data). Only words here: every number and verdict is in the data."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from gradientflow_repro.render import table

Document = Mapping[str, Any]


# ------------------------------------------------------------------ the projection (results/scaling.md)
def projection(document: Document) -> str:
    """A projection's report: title, provenance, the calibration terms it took, its tables, the
    paper's calibrated band (for the paper's setup) and its figure."""
    terms = _terms_section(document.get("terms") or [])
    band = _band_section(document["band"]) if document.get("band") and document["paper"] else []
    lines = ["# Scaling model" + (" against the paper" if document["paper"] else ""), "",
             f"Command: `{document['command']}`; commit {document['commit']}; a model: no machine's speed enters it. "
             "The model's rules are checked against measurement on an emulated two-level cluster "
             "(`results/cluster_comm.md`) and in the training ladder (`results/REPORT.md`).", "",
             *projection_lines(document), *(["", *terms] if terms else []), *(["", *band] if band else []), "",
             f"![speedup against GPUs]({document['figure']})", ""]
    return "\n".join(lines)


def _terms_section(terms: Sequence[Mapping[str, Any]]) -> list[str]:
    """The fitted terms the setup took, each with its value and source."""
    if not terms:
        return []
    return ["## Fitted terms and their sources", "",
            "Each term of the model that published results fit (`scaling/calibration.py`), as this projection "
            "took it, with its source:", "",
            table(["term", "value", "source"], [(t["term"], t["shown"], t["source"]) for t in terms])]


def projection_lines(data: Document) -> list[str]:
    """The projection's body (what ``projection.paper_check`` returns): setup, sources, checks, tables,
    sensitivity and breakdown."""
    setup, paper, checks = data["setup"], data["paper"], data.get("checks")
    counts = data["counts"]
    readiness = setup["readiness"]
    per_element = setup["bytes_per_element"]
    lines = [
        f"Setup: model `{setup['model']}` at {setup['image_size']} pixels, {setup['images_per_gpu']} images per GPU, "
        f"one GPU at {setup['single_gpu_images_s']:,.0f} images/s (a step of {setup['step_s'] * 1e3:.1f} ms: forward "
        f"{setup['forward_s'] * 1e3:.1f}, backward {setup['backward_s'] * 1e3:.1f}, split by FLOPs: "
        f"{setup['forward_gflops']:.2f} GFLOPs forward and {setup['backward_gflops']:.2f} backward per image), "
        f"{setup['elements'] / 1e6:.1f}M gradients; links of {setup['link_gbps']:g} Gbit/s per node, "
        f"{setup['gpus_per_node']} GPUs per node sharing it, {setup['intra_node_GBps']:g} GB/s inside a node, "
        f"{setup['latency_us']:g} us per message; CSC's, the fp16 wire's and PowerSGD's local work at "
        f"{setup['gpu_memory_GBps']:g} GB/s of GPU memory traffic ({per_element['csc']}, "
        f"{per_element['fp16_wire']} and {per_element['low_rank']} bytes per element)"
        + "".join(f"; {said}" for said in setup["extras"]) + ". Weak scaling.", "",
        "Sources: " + (setup["paper_dense_ratio"] + ". " if setup.get("paper_dense_ratio") else "") +
        "Backward readiness: FLOPs of the real model counted by `torch.utils.flop_counter` "
        "(`gradientflow_repro/scaling/profile.py`"
        + (f"; shipped as `{setup['shipped_profile']}`" if setup.get("shipped_profile") else "") + "). "
        f"The largest gradient ({readiness['largest_elements'] / 1e6:.1f}M elements) is complete "
        f"{100 * readiness['ready_share_by_flops']:.0f}% into backward by FLOPs; spread by parameter count it would "
        f"be {100 * readiness['ready_share_by_count']:.0f}%. "
        "Assumed where the paper is silent (`gradientflow_repro/scaling/perfmodel.py`): GPUs per node, latency, "
        "intra-node rate, GPU memory rate; their effect is in the sensitivity table below."]
    fitted = bool(checks and checks["goals"] is not None)
    ceiling = " (uncalibrated: nominal links, free overlap, no per-step overhead; a ceiling, not a forecast)"
    if paper:
        lines += ["", *_checks_lines(checks)]
        if fitted:
            lines += ["", f"Predicted speedup against GPU count, calibrated (central setup: {_terms(checks)}):",
                      "", _speedup_table(data["calibrated"], counts)]
    lines += ["", "Predicted speedup against GPU count" + (ceiling if paper else "") + ":", "",
              _speedup_table(data["ceiling"], counts)]
    uneven = data.get("uneven")
    if uneven:
        lines += ["", f"World sizes that are not a multiple of {uneven['gpus_per_node']} (the last node half filled"
                  + (", calibrated" if fitted else ceiling if paper else "") + "):",
                  "", _speedup_table(uneven["table"], uneven["counts"])]
    if data.get("sensitivity"):
        gpus = data["breakdown"]["gpus"]
        lines += ["", "## Sensitivity" + (" (calibrated)" if fitted else ""), "", *_sensitivity(data["sensitivity"]),
                  "", f"## Where the full stack's step goes at {gpus} GPUs" + (" (calibrated)" if fitted else ""), "",
                  *_breakdown(data["breakdown"])]
    return lines


def _terms(checks: Document) -> str:
    return (f"links at {checks['link_efficiency']:g} of their rate, backward slowed by {checks['overlap_slowdown']:g} "
            "s per second of communication it overlaps, no framework overhead")


def _speedup_table(speedups: Mapping[str, Sequence[float]], counts: Sequence[int]) -> str:
    return table(["strategy", *map(str, counts)], [(name, *(f"{v:.1f}" for v in values))
                                                   for name, values in speedups.items()])


def _met(verdict: bool) -> str:
    return "met" if verdict else "NOT met"


def _checks_lines(checks: Document) -> list[str]:
    """The checks against the paper, worded from their verdicts (``goals``); without a calibration
    the ceilings alone."""
    at512, at64 = checks["ceiling_full_stack_512"], checks["ceiling_baseline_64"]
    goals = checks["goals"]
    if goals is None:
        return ["Uncalibrated (asked for, or no calibration written by `python scripts/model_check.py`), so no goal "
                f"is judged here: the model gives `gradientflow` {at512:.1f}x at 512 GPUs and `allreduce` "
                f"{at64:.1f}x at 64, ceilings set by communication alone (nominal links, free overlap, no per-step "
                "overhead) that over-predict every published result."]
    band, paper, baseline = checks["band"], checks["paper_speedup"], checks["paper_baseline_speedup"]
    lazy, below = checks["lazy"], checks["lazy_counts_below"]

    def central(label: str) -> str:
        entry = band[label]
        return f"{entry['central']:.1f}x; band {entry['low']:.1f}x - {entry['high']:.1f}x"

    rows = [
        ("full stack (`gradientflow`, two-level ring), 512 GPUs", f"{paper}x", f"{at512:.1f}x", central("gradientflow"),
         f"band contains {paper:g}x: {_met(goals['full_stack_band_contains_paper'])}"),
        (f"`gradientflow` above dense lazy (`{lazy}`) from 16 GPUs", "-", "-",
         "yes at every count" if goals["full_stack_above_dense_lazy_from_16"]
         else "not at " + ", ".join(map(str, below)), _met(goals["full_stack_above_dense_lazy_from_16"])),
        ("naive baseline (`allreduce`), 64 GPUs", f"{baseline}x", f"{at64:.1f}x", central("allreduce"),
         f"band contains {baseline:g}x: {_met(goals['baseline_band_contains_paper'])}: the calibrated model reaches "
         f"2.5x with links of {checks['baseline_link_gbps_for_paper']:.1f} Gbit/s effective, or "
         f"{checks['baseline_latency_s_for_paper'] * 1e3:.2f} ms per message at 56 Gbit/s; the baseline systems used "
         "neither the link's rate nor its latency (TCP, parameter servers)"),
        ("full stack on our flat ring, 512 GPUs", "-", f"{checks['ceiling_flat_512']:.1f}x",
         f"{checks['calibrated_flat_512']:.1f}x",
         "the flat ring's 2(N-1) = 1022 latencies per pool part are why the two-level ring is the default")]
    lines = [f"Every goal below is judged on the calibrated model (`results/model_check.md`, {_terms(checks)}; "
             f"the band spans the paper's unknowns and the test rows' RMS error, {checks['test_rms_points']:.1f} "
             "points); the uncalibrated figure is a ceiling set by communication alone, shown for comparison only.", "",
             table(["check", "paper", "uncalibrated ceiling", "calibrated (central; band)", "goal"], rows)]
    if checks["peers"]:
        lines += ["", "At 512 GPUs, the full stack beside DDP and what ships in PyTorch (its fp16 and PowerSGD "
                  "hooks, each after its dense warm-up: the steady state), calibrated as above:", "",
                  table(["strategy", "uncalibrated ceiling", "calibrated central", "band"],
                        [(f"`{p['label']}`", f"{p['ceiling']:.1f}x", f"{p['central']:.1f}x",
                          f"{p['low']:.1f}x - {p['high']:.1f}x") for p in checks["peers"]])]
    return lines


def _versus(above: bool) -> str:
    return "above" if above else "BELOW"


def _sensitivity(data: Document) -> list[str]:
    label, gpus, versus = data["label"], data["gpus"], data["versus_paper"]
    header = ["assumption (others as above)", f"`{label}` at {gpus} GPUs"]
    rows: list[tuple] = [(row["what"], f"{row['speedup']:.1f}x", *([_versus(row["above_paper"])] if versus else []))
                         for row in data["rows"]]
    for row in data["local_work"]:
        what = f"GPU local work {row['local_work_ms']:.0f} ms per step (hidden as the setup has it; not hidden)"
        rows.append((what, f"{row['hidden']:.1f}x; {row['unhidden']:.1f}x",
                     *([f"{_versus(row['hidden_above_paper'])}; {_versus(row['unhidden_above_paper'])}"]
                       if versus else [])))
    if versus:
        header.append(f"vs the paper's {data['paper_speedup']}x")
    latencies = data["latencies_us"]
    return [table(header, rows), "", f"Latency and node size together (`{label}`, speedup at {gpus} GPUs):", "",
            table(["GPUs per node", *(f"{lat} us" for lat in latencies)],
                  [(per_node, *(f"{v:.1f}x" for v in values))
                   for per_node, values in zip(data["node_sizes"], data["grid"])])]


def _breakdown(data: Document) -> list[str]:
    rows = [(index, f"{m['ready_s'] * 1e3:.1f}", f"{m['payload_bytes'] / 1e6:.2f}", f"{m['small_bytes'] / 1e3:.1f}",
             f"{m['local_work_s'] * 1e3:.2f}", f"{m['busy_s'] * 1e3:.2f}", f"{m['ends_s'] * 1e3:.1f}")
            for index, m in enumerate(data["messages"])]
    return [table(["message", "ready (ms)", "payload (MB)", "small allreduce (KB)", "local work (ms)", "busy (ms)",
                   "ends (ms)"], rows), "",
            f"Backward ends at {data['backward_s'] * 1e3:.1f} ms; communication exposed after it "
            f"{data['exposed_comm_s'] * 1e3:.2f} ms; step {data['step_s'] * 1e3:.1f} ms against "
            f"{data['compute_s'] * 1e3:.1f} ms of compute."]


def _band_table(band: Mapping[str, Mapping[str, Any]]) -> str:
    return table(["strategy", "GPUs", "paper", "central", "band"],
                 [(f"`{label}`", entry["gpus"], f"{entry['reported']:g}x" if entry["reported"] else "-",
                   f"{entry['central']:.1f}x", f"{entry['low']:.1f}x - {entry['high']:.1f}x")
                  for label, entry in band.items()])


def _band_section(band: Optional[Document]) -> list[str]:
    """The paper's band as ``scripts/model_check.py`` fitted it (``calibration.band_section``'s data)."""
    if not band:
        return []
    return ["## The paper's projection, calibrated on published results", "",
            f"From `{band['command']}` (commit {band['commit']}, `results/model_check.md`): the model's free "
            f"parameters fitted on published results (fit RMS {band['fit_rms_points']:.1f} points, test RMS "
            f"{band['test_rms_points']:.1f}), the paper's unknowns (GPUs per node, GPU, framework overhead, how "
            "much local work backward hides) spanned, the band widened by the test RMS.", "",
            _band_table(band["paper_band"])]


# ------------------------------------------------------------------ against published results (results/model_check.md)
def model_check(document: Document) -> str:
    """The model against published results: the fit, both subsets, the paper's band and its parts,
    time to train, the per-step excess, why the test misses remain and the readiness measured."""
    params, env = document["parameters"], document["environment"]
    rows = document["rows"]
    ib56 = document["ib56_efficiency"]
    one_process = set(document["one_process_per_node"])
    outside = document["rows_outside_goal"]
    fit = ["- link efficiency: " + ", ".join(f"{k} ({document['fabrics'][k]}) {v:.3f}"
                                             for k, v in sorted(params["link_efficiency"].items())),
           "- intra-node efficiency: " + ", ".join(f"{k} {v:.3f} of {document['intra_node_GBps'][k]:g} GB/s"
                                                   for k, v in sorted(params["intra_efficiency"].items())),
           f"- overlap slowdown: {params['overlap_slowdown']:.3f}",
           "- step overhead: " + ", ".join(
               f"{k} {1e3 * v:.1f} ms" + (" per GPU beyond the first that its one process drives"
                                          if k in one_process else "")
               for k, v in sorted(params["step_overhead_s"].items())),
           f"- priors for fabrics no fitted row measures: {document['priors']} (ib56: NCCL's maintainers' 96%)"]
    verdict = "met" if document["goal_met"] else f"NOT met by {len(outside)} rows"
    lines = ["# The scaling model against published results", "",
             f"Command: `{document['command']}`; commit {env.get('git_commit', 'unknown')}; machine: {env.get('cpu')} "
             f"({env.get('cpu_count')} cores), {env.get('platform')}, torch {env.get('torch')}. The model is "
             "analytic: no machine's speed enters the table; the readiness section below is measured on this CPU.",
             "", "Sources and setups: `gradientflow_repro/scaling/published.py` (each row's note names what is "
             "assumed). Confidence: H the source's own table or text, M a secondary source.", "",
             f"## Fit (least squares by coordinate descent on grids; free: {', '.join(document['free'])})", "",
             f"Fitted on {document['fitted_rows']} rows, RMS error {document['fit_rms_points']:.1f} points; test on "
             f"{document['test_rows']} rows, RMS error {document['test_rms_points']:.1f} points. Goal: every row "
             f"within {document['goal_points']} points (15% of a speedup where only a speedup is given): {verdict}; "
             f"errors of sign {', '.join(document['error_signs'])}.", "", *fit, "",
             "## Fitted subset", "", _rows_table([r for r in rows if r["subset"] == "fitted"]), "",
             "## Test subset", "", _rows_table([r for r in rows if r["subset"] == "test"]), "",
             "Commands that project each row (the options of `scripts/simulate_scaling.py`):", ""]
    lines += [f"- {r['name']}: `{r['command']}`" for r in rows]
    lines += ["", "Rows marked ring-only were fitted and checked on NCCL's ring alone (the 2017 systems' flat ring); "
              "the command line prices NCCL's faster of ring and tree, which differs only where latency dominates."]
    unknowns = document["paper_unknowns"]
    lines += ["", "## The paper's projection with its spread", "",
              f"Function `calibration.paper_band`. Unknowns: GPUs per node {tuple(unknowns['gpus_per_node'])}, "
              "single-GPU AlexNet throughput "
              f"{', '.join(f'{k} {v:,.0f}' for k, v in unknowns['single_gpu'].items())} images/s, "
              f"framework overhead 0 or Horovod's fitted; the local work (CSC's, the fp16 wire's, PowerSGD's) "
              f"hidden by backward as communication is, or not at all (`Network.local_work_slowdown` 1: no "
              f"published row has local work to fit it on); 56 Gbit/s at efficiency {ib56:.2f}; the "
              f"band widened by the test RMS ({document['test_rms_points']:.1f} points).", "",
              _band_table(document["paper_band"])]
    paper = document["paper_speedup"]
    lines += ["", f"Which part of {paper}x the full stack reaches, term by term (`calibration.paper_decomposition`; "
              "central setup: 8 GPUs per node, the paper's implied single-GPU throughput, PCIe inside a node):", "",
              table(["model", "`gradientflow` at 512 GPUs", f"of {paper}x"],
                    [(d["model"], f"{d['speedup']:.1f}x", f"{d['speedup'] / paper:.2f}")
                     for d in document["decomposition"]])]
    lines += ["", "Every combination:", "",
              table(["strategy", "GPUs per node", "GPU", "overhead (ms)", "local work hidden", "speedup"],
                    [(f"`{label}`", g["gpus_per_node"], g["gpu"], f"{1e3 * g['overhead_s']:.1f}",
                      "as communication" if g.get("local_work_slowdown") is None else "no", f"{g['speedup']:.1f}x")
                     for label, entry in document["paper_band"].items() for g in entry["grid"]])]
    run = document["time_to_train_s"]
    lines += ["", "## Time to train (the paper: 95 epochs in 1.5 minutes)", "",
              f"`perfmodel.time_to_train`, central setup: steady state only {run['steady'] / 60:.2f} min; with "
              f"{run['dense_warmup_epochs']} dense warm-up epochs at the dense lazy step "
              f"({run['dense_step_s'] * 1e3:.1f} ms against {run['step_s'] * 1e3:.1f} ms) "
              f"{run['with_dense_warmup'] / 60:.2f} min; evaluation and start-up not known (0 here), each "
              "adds to it. The paper's 1.5 min is the comparison."]
    lines += ["", *_excess(document.get("excess"))]
    lines += ["", *_misses(rows, document["miss_reasons"])]
    lines += _readiness(document.get("readiness") or {})
    return "\n".join(lines) + "\n"


def _rows_table(rows: Sequence[Mapping[str, Any]]) -> str:
    def cells(r: Mapping[str, Any]) -> tuple:
        speed = f" ({r['reported_speedup']:g}x)" if r["reported_speedup"] else ""
        predicted = f" ({r['predicted_speedup']:.1f}x)" if r["reported_speedup"] else ""
        ring = ", ring-only" if r["ring_only"] else ""
        return (f"{r['name']} (`{r['strategy']}`{ring})", f"{r['source']} [{r['confidence']}]",
                f"{100 * r['reported_efficiency']:.1f}%{speed}", f"{100 * r['predicted_efficiency']:.1f}%{predicted}",
                f"{r['error_points']:+.1f}", "yes" if r["within_goal"] else "NO", r["subset"])

    return table(["setup", "source", "reported", "predicted", "error (points)", "within goal", "subset"],
                 [cells(r) for r in rows])


def _excess(excess: Optional[Document]) -> list[str]:
    if not excess:
        return []
    return ["## Per-step excess of one process driving a node's GPUs", "",
            "TF's replicated benchmarks on one DGX-1 (`calibration.excess_s`): how much longer each step is than "
            "the single-GPU step (images per GPU fixed), as reported and as predicted, and the modelled framework "
            "overhead within the predicted one (`calibration.step_overhead_s`). Gradient bytes per step: "
            + ", ".join(f"{name} {size / 1e6:,.0f} MB" for name, size in excess["gradient_bytes"].items())
            + ". Why per GPU: " + "; ".join(f"{k}: {why}" for k, why in excess["why_per_gpu"].items()) + ".", "",
            table(["setup", "fitted", "reported excess (ms)", "predicted excess (ms)",
                   "of it, framework overhead (ms)"],
                  [(r["name"], "yes" if r["fitted"] else "no", f"{1e3 * r['reported_s']:.1f}",
                    f"{1e3 * r['predicted_s']:.1f}", f"{1e3 * r['overhead_s']:.1f}") for r in excess["rows"]])]


def _misses(rows: Sequence[Mapping[str, Any]], reasons: Mapping[str, str]) -> list[str]:
    misses = [r for r in rows if r["name"] in reasons]
    if not misses:
        return []
    return ["## Why the test misses remain", "",
            "Each is over-predicted; for each, what the table shows and why no further term was added (a term "
            "is kept only if fitted on the fitted subset, it improves the test subset and a source names it):", "",
            *(f"- {r['name']} ({r['error_points']:+.1f} points): {reasons[r['name']]}." for r in misses)]


def _readiness(readiness: Mapping[str, Sequence[Sequence[float]]]) -> list[str]:
    if not readiness:
        return []
    largest = {name: max(tuple(row) for row in rows) for name, rows in readiness.items()}
    return ["", "## Backward readiness: FLOPs against a per-layer profile measured on this CPU", "",
            "Fraction of backward done when each weight's gradient is complete (torchvision models at 224; "
            "measured: `profile.measure_profile`, medians of 3 steps, batch 16 for AlexNet and 2 for VGG-16, "
            "this machine's CPU).", "",
            table(["model", "weight elements", "by FLOPs", "measured on CPU", "difference (points)"],
                  [(name, f"{e:,}", f"{100 * f:.1f}%", f"{100 * m:.1f}%", f"{100 * (m - f):+.1f}")
                   for name, rows in readiness.items() for e, f, m in rows]), "",
            "The largest gradient (the first fully connected layer) is ready "
            + "; ".join(f"{name}: {100 * f:.1f}% into backward by FLOPs, {100 * m:.1f}% measured"
                        for name, (_, f, m) in largest.items())
            + ". FLOPs leave out memory-bound work (ReLU, pooling, dropout, the weight gradients' own "
            "memory traffic), a larger share of a CPU's backward than of a GPU's, so a GPU lies between the "
            "two columns; FLOP readiness is the end that favours overlap. Only a GPU profile can say where: "
            "none is measured here."]
