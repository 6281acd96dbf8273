"""Communication alone, on an emulated cluster of nodes: what an analytic scaling model is checked
against, in the regime where the paper's effects live (the network, not the CPU, is the limit).

For a model's real gradients (their sizes, and the order in which backward makes them ready,
recorded once from a real backward pass) every rank runs steps without training: a tiny autograd
graph (``Replay``) releases a fixed random gradient for each parameter in backward order with no
computation in between, so the communicators' post-accumulate-grad hooks (and DDP's) fire as in real
training, then ``comm.synchronize()``. A step's communication time is from the start of backward to
the end of ``synchronize()``, on the slowest rank. Communicators come from the factory, as the
trainer builds them; CSC is in its sparse phase (epoch 10, after its dense warm-up).

Each layout (nodes x ranks per node) is one launch of the ranks into the emulated cluster
(``cluster.netemu``: a namespace per node, ranks of a node on its loopback, one tbf-shaped uplink
per node), and measures in the same launch the network as an analytic model needs it: per-message
latency and bandwidth between node leaders (the uplink), inside a node, and over the flat ring of
all ranks, and the backend's own allreduce by message size. Every layout is launched ``launches``
times, in rounds (each round launches every layout once, so a drift of the shared host touches
them alike): with more ranks than cores a strategy's step moves between launches far more than
within one, so one launch is a draw, and what is reported and set against the
model is the median over the launches, each launch's figure beside it. Each rank runs
``bench.cluster_rank``; the gradients it replays are ``bench.replay``'s.

The rate is checked to make the runs network-bound: the dense strategies of the first layout run
again on links twice as fast (the largest must take about half as long) and unshaped (what CPU and
per-message costs alone take). The measurements go to a JSON document (``render.write_data``,
kind ``bench.cluster_comm``) with the check's verdict as a value; ``render/bench.py`` makes the
Markdown from it. ``scripts/bench_cluster.py`` is the command line.

The strategies' labels and options are read (``bench/lineup.py``, ``variants.py``) in one place,
the section "what is measured" below (``strategy_labels``, ``strategy_options``, ``dense_fp32``, ``algorithm``).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from gradientflow_repro import REPO, render, variants
from gradientflow_repro.bench import lineup, provenance
from gradientflow_repro.bench.replay import backward_order, build, model_spec
from gradientflow_repro.cluster import netemu
from gradientflow_repro.cluster.launch import network, run_ranks
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.render.bench_cluster import suggestion
from gradientflow_repro.reproduction.progress import MACHINE_KEYS, Progress, Timeline
from gradientflow_repro.scaling.cluster_check import model_check, over_launches

log = logging.getLogger(__name__)
MODULE = ("-m", "gradientflow_repro.bench.cluster_rank")
KIND = "bench.cluster_comm"  # the renderer of the JSON this benchmark writes
# (world, ranks per node): 8 ranks as 2 nodes x 4 and 4 nodes x 2, 4 ranks as 2 nodes x 2
LAYOUTS: tuple[tuple[int, int], ...] = ((8, 4), (8, 2), (4, 2))
# Per node uplink, Mbit/s. The run must be network-bound (the check below) on a slow 2-core machine
# too, where the CPU's share of a step is largest: at 50 such a machine's densest strategy of 8
# ranks nearly halves its step at twice the rate, where at 100 it did not (the measurements:
# results/cluster_comm.md). A check that fails names a rate that would pass (``rate_for_speedup``).
RATE_MBIT = 50.0
# Launches of every layout (see the module's docstring): the median of 3 is the least that outvotes one
# launch's draw.
LAUNCHES = 3
RUNS_DIR = REPO / "results" / "runs" / "bench_cluster"  # the ranks' logs and progress.json
OUT_MD, OUT_JSON = render.RESULTS / "cluster_comm.md", render.RESULTS / "cluster_comm.json"


# -------------------------------------------------------------------------- what is measured
def strategy_labels() -> tuple[str, ...]:
    """The strategies this benchmark measures unless told (``lineup.cluster_bench``)."""
    return lineup.cluster_bench()


def strategy_options(label: str, ranks_per_node: int) -> dict[str, Any]:
    """The ``comm.*`` options of a strategy label (``variants.py``; a label that forces the
    two-level ring takes the layout's ranks per node)."""
    return variants.options(label, ranks_per_node)


def dense_fp32(options: dict[str, Any]) -> bool:
    """Whether a strategy sends every gradient in fp32 (the most bytes): the network-bound check's candidates."""
    plan = resolve(options)
    return not plan.sends_sparse and plan.wire == "fp32"


def algorithm(options: dict[str, Any]) -> str:
    """The allreduce algorithm a strategy's options choose (``builtin``, or one of ours, which the
    ranks give this network's switch-over between recursive doubling and the ring)."""
    return resolve(options).algorithm


# ---------------------------------------------------------------------------------------- the driver
def run_layout(world: int, ranks_per_node: int, rate_mbit: Optional[float], labels: Sequence[str],
               model: dict[str, Any], order: list[int], run_dir: Path, reason: Optional[str], steps: int = 5,
               warmup: int = 1, measure: Optional[str] = "full", timeout_s: float = 600,
               launch: int = 1) -> dict[str, Any]:
    """One launch (the ``launch``-th of this layout) of ``world`` ranks as nodes of ``ranks_per_node``
    on uplinks of ``rate_mbit`` (loopback when ``reason`` says why the network cannot be emulated):
    the network (``measure``: "full", "links" without the builtin table, or None) and the strategies
    ``labels``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {"model": model, "order": order, "ranks_per_node": ranks_per_node, "steps": steps, "warmup": warmup,
            "measure": measure, "strategies": [[label, options, algorithm(options)] for label in labels
                           for options in [strategy_options(label, ranks_per_node)]]}
    (run_dir / "spec.json").write_text(json.dumps(spec))
    out = run_dir / "measured.json"
    name = f"{world // ranks_per_node}x{ranks_per_node}"
    started = time.time()
    with network(world, rate_mbit, reason, ranks_per_node=ranks_per_node) as net:
        payload_Bps, burst = (net.payload_Bps, net.burst_payload_bytes) if net else (None, 0.0)
        run_ranks(world, [str(out), str(run_dir / "spec.json")], run_dir, name, net, timeout_s, module=MODULE)
    measured = json.loads(out.read_text())
    facts = {"layout": name, "world": world, "nodes": world // ranks_per_node, "ranks_per_node": ranks_per_node,
             "rate_mbit": rate_mbit if reason is None else None, "shaped_payload_Bps": payload_Bps,
             "burst_payload_bytes": burst, "launch": launch}
    return {**facts, "network": measured["network"], "launch_s": time.time() - started,
            "rows": [{**facts, **row} for row in measured["rows"]]}


def bench_cluster(out_md: Path = OUT_MD, out_json: Path = OUT_JSON, rate_mbit: float = RATE_MBIT,
                  layouts: Sequence[tuple[int, int]] = LAYOUTS, labels: Optional[Sequence[str]] = None,
                  steps: int = 5, warmup: int = 1, emulate: bool = True, check: bool = True,
                  experiment: str = "digits_cpu", runs_dir: Path = RUNS_DIR, measure: Optional[str] = "full",
                  command: str = "python scripts/bench_cluster.py", launches: int = LAUNCHES,
                  fresh: bool = False) -> str:
    """Every layout ``launches`` times, in rounds, and after the first round the network-bound check
    (the dense fp32 strategies of the first layout again at twice the rate and unshaped); writes
    ``out_json`` (raw rows, each with its launch) and ``out_md``; returns the Markdown. Each finished
    launch is saved as it ends (``progress.Progress`` in ``runs_dir``): run again with the same plan
    (these options, the code, the machine), an interrupted benchmark keeps them and goes on; another
    plan raises ``CannotContinue`` unless ``fresh``. ``labels``: the strategies, registry labels
    (None: ``strategy_labels()``)."""
    from gradientflow_repro.provenance import code_version, environment_facts

    labels = list(strategy_labels() if labels is None else labels)
    if launches < 1:
        raise ValueError(f"--launches {launches}: must be at least 1")
    reason = netemu.why_unavailable() if emulate else "disabled by --no-emulation"
    machine = environment_facts()
    plan = {"layouts": [list(layout) for layout in layouts], "launches": launches, "strategies": list(labels),
            "steps": steps, "warmup": warmup, "rate_mbit": rate_mbit, "emulated": reason is None, "check": check,
            "experiment": experiment, "measure": measure, "code": code_version(),
            "machine": {key: machine[key] for key in MACHINE_KEYS}}
    with Progress(runs_dir, plan, fresh, name="bench_cluster", what="cluster benchmark") as progress:
        from gradientflow_repro.scaling.profile import matrix_rows

        model = model_spec(experiment)
        order = backward_order(model)
        params = [p for p in build(model).parameters() if p.requires_grad]
        # [elements, one-dimensional, first dimension]: the last is how PowerSGD views it as a matrix
        tensors = [[params[i].numel(), params[i].dim() <= 1, matrix_rows(params[i])] for i in order]
        model = {**model, "tensors_in_backward_order": tensors, "parameters": sum(t[0] for t in tensors)}
        kept = f"; continuing: {progress.kept} finished job(s) kept" if progress.kept else ""
        log.info(f"{model['name']} ({model['parameters'] / 1e6:.2f}M parameters, {len(tensors)} tensors); "
              f"network: {'emulated, uplinks %g Mbit/s' % rate_mbit if reason is None else 'loopback (' + reason + ')'}"
              f"{kept}")
        jobs = [(launch, world, per_node) for launch in range(1, launches + 1) for world, per_node in layouts]
        checked = check and reason is None
        planned = [(f"{w // n}x{n} launch{k}", "launch", f"{w // n}x{n}") for k, w, n in jobs]  # name, kind, key
        if checked:
            planned.insert(len(layouts), ("rate check", "check", "rate"))  # after the first round
        timeline = Timeline([(kind, key) for name, kind, key in planned if progress.done(name) is None],
                            name="bench_cluster", guess_s={"launch": 200.0, "check": 150.0})
        results, rate_check = [], None
        for index, (launch, world, per_node) in enumerate(jobs):
            name = f"{world // per_node}x{per_node}"
            job = f"{name} launch{launch}"
            result = progress.done(job)
            if result is None:
                timeline.begin("launch", name, f"launch {launch}/{launches} of {world // per_node} nodes x "
                               f"{per_node} ranks")
                run_dir = runs_dir / name / f"launch{launch}"
                shutil.rmtree(run_dir, ignore_errors=True)  # a launch cut short left its logs: start clean
                result = run_layout(world, per_node, rate_mbit, labels, model, order, run_dir, reason, steps, warmup,
                                    measure, launch=launch)
                progress.record(job, result)
            results.append(result)
            if index + 1 == len(layouts) and checked:  # after the first round
                rate_check = progress.done("rate check")
                if rate_check is None:
                    timeline.begin("check", "rate", f"network-bound check on {results[0]['layout']} "
                                   "(twice the rate, and unshaped)")
                    try:
                        rate_check = network_bound_check(results[0], model, order, runs_dir / "rate_check", steps,
                                                         warmup)
                        progress.record("rate check", rate_check)
                        if not rate_check["network_bound"]:  # said now, not only after the last round
                            log.warning(f"NOT network-bound at {rate_mbit:g} Mbit/s "
                                        f"({rate_check['speedup']:.2f}x at twice the rate, "
                                        f"{NETWORK_BOUND_SPEEDUP:g}x required): the model check will not be one "
                                        "of the network; stop and run again with a lower --rate-mbit"
                                        f"{suggestion(rate_check)}")
                    except RuntimeError as error:  # said in the report; the rounds go on (not kept: tried again)
                        rate_check = {"layout": results[0]["layout"], "error": str(error)}
                        log.warning(str(error))
        timeline.end()
        facts = {"provenance": provenance(command, " ".join(f"{w // n}x{n}" for w, n in layouts), machine),
                 "machine": machine, "command": command, "elapsed_s": progress.elapsed_s,
                 "invocations": len(progress.state["launches"]),
                 "emulated": reason is None, "why_not": reason, "rate_mbit": rate_mbit if reason is None else None,
                 "steps": steps, "warmup": warmup, "launches": launches, "model": model, "rate_check": rate_check,
                 "layouts": [{k: v for k, v in r.items() if k != "rows"} for r in results],
                 "rows": [row for r in results for row in r["rows"]], "burst_bytes": netemu.BURST_BYTES}
        facts["rows_over_launches"] = over_launches(facts["rows"])  # each strategy's median over the launches
        if facts["emulated"]:  # the scaling model on these measurements, its goals' verdicts as values
            facts["model_check"] = model_check(facts)
        document = render.write_data(out_json, KIND, facts)
        text = render.render_file(document, out_md).read_text()
        progress.finish()
    log.info(f"wrote {out_md} and {out_json} in {facts['elapsed_s']:.0f}s")
    return text


NETWORK_BOUND_SPEEDUP = 1.7  # at twice the rate the largest dense strategy must be this much faster
SUGGESTED_SPEEDUP = 1.8  # what a suggested lower rate aims at: a margin over the requirement, for noise


def _fixed_and_wire(at_rate_s: float, at_double_s: float) -> tuple[float, float]:
    """The fixed part f and the wire part w of a step that takes f + w at some rate and f + w/2 at
    twice it."""
    wire = 2.0 * (at_rate_s - at_double_s)
    return at_rate_s - wire, wire


def rate_for_speedup(rate_mbit: float, at_rate_s: float, at_double_s: float,
                     speedup: float = SUGGESTED_SPEEDUP) -> Optional[float]:
    """The highest uplink rate at which a step measured at ``rate_mbit`` (``at_rate_s``) and at
    twice it (``at_double_s``) would be ``speedup`` times faster at twice that rate, by the split
    these two imply: a fixed part (CPU, per-message costs) f and a wire part w that scales with 1/rate,
    t = f + w, t2 = f + w/2. At rate r the wire part is w * rate_mbit / r, and (f + w') / (f + w'/2)
    >= s needs w' >= f (s - 1) / (1 - s/2). None when the two times show no wire part, ``rate_mbit``
    itself when they show no fixed part."""
    fixed, wire = _fixed_and_wire(at_rate_s, at_double_s)
    if wire <= 0 or not 1.0 < speedup < 2.0:
        return None
    if fixed <= 0:
        return rate_mbit
    return rate_mbit * wire / (fixed * (speedup - 1.0) / (1.0 - speedup / 2.0))


def network_bound_check(layout: dict[str, Any], model: dict[str, Any], order: list[int], run_dir: Path,
                        steps: int, warmup: int) -> dict[str, Any]:
    """The dense fp32 strategies of ``layout`` again on uplinks twice as fast, and unshaped (what
    the CPU and per-message costs alone allow): a network-bound strategy nearly halves at twice the
    rate and takes a small part of its time unshaped. The verdict is on the largest dense strategy
    (the most bytes; of those the slowest)."""
    dense = [r for r in layout["rows"] if r["error"] is None and dense_fp32(r["options"])]
    if not dense:
        raise RuntimeError("network-bound check: no dense fp32 strategy ran")
    largest = max(dense, key=lambda r: (r["bytes_per_step"], r["comm_s_median"]))
    labels = [r["strategy"] for r in dense]
    rate = layout["rate_mbit"]
    runs = {"double": run_layout(layout["world"], layout["ranks_per_node"], 2 * rate, labels, model, order,
                                 run_dir / "double", None, steps, warmup, measure="links"),
            "unshaped": run_layout(layout["world"], layout["ranks_per_node"], None, labels, model, order,
                                   run_dir / "unshaped", None, steps, warmup, measure="links")}
    rows = []
    for row in dense:
        again = {name: next(r for r in run["rows"] if r["strategy"] == row["strategy"]) for name, run in runs.items()}
        failed = [f"{name}: {r['error']}" for name, r in again.items() if r["error"]]
        if failed:
            raise RuntimeError(f"network-bound check: {row['strategy']} failed ({'; '.join(failed)})")
        rows.append({"strategy": row["strategy"], "bytes_per_step": row["bytes_per_step"],
                     "comm_s": row["comm_s_median"], "double_comm_s": again["double"]["comm_s_median"],
                     "unshaped_comm_s": again["unshaped"]["comm_s_median"],
                     "speedup": row["comm_s_median"] / again["double"]["comm_s_median"],
                     "unshaped_share": again["unshaped"]["comm_s_median"] / row["comm_s_median"]})
    head = next(r for r in rows if r["strategy"] == largest["strategy"])
    leaders = {name: (run["network"] or {}).get("leaders") for name, run in
               (("rate", layout), ("double", runs["double"]), ("unshaped", runs["unshaped"]))}
    return {"layout": layout["layout"], "rate_mbit": rate, "double_rate_mbit": 2 * rate, **head,
            "network_bound": head["speedup"] >= NETWORK_BOUND_SPEEDUP, "rows": rows,
            "suggested_rate_mbit": rate_for_speedup(rate, head["comm_s"], head["double_comm_s"]),
            "leader_bandwidth_Bps": {name: f["segmented"]["bandwidth_Bps"] if f else None
                                     for name, f in leaders.items()},
            "networks": {name: run["network"] for name, run in runs.items()},
            "required_speedup": NETWORK_BOUND_SPEEDUP, "suggested_speedup": SUGGESTED_SPEEDUP}

