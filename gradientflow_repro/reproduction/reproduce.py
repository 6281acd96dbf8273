"""The paper's comparison on one machine: the ablation ladder, each rung trained over the whole
schedule on an emulated cluster network once per seed, then results/REPORT.md with both criteria
read from the same runs: MLPerf's (time to the target accuracy, at the first evaluation at or above
it) and the paper's (the fixed schedule: the time to finish it, top-1 at the end).

Steps: (1) calibrate: profile the model (``scaling.profile``), run the baseline briefly on an
unshaped network to get compute time and bytes per step; (2) choose the link rate that gives the
paper's dense communication/computation ratio; (3) measure the shaped network's bandwidth and per-
message latency (``scaling.netbench``); (4) train every rung of the ladder (``lineup.LADDER``,
``reproduction/lineup.py``), gradientflow's variants for convergence (``lineup.SPARSE_VARIANTS``)
and the peers, what
researchers would use instead and the paper's stack as published (``lineup.PEERS``: PyTorch's fp16 and
PowerSGD hooks, ``gradientflow-paper``), or the experiment's own default set (``DEFAULT_RUNGS``),
over the whole schedule (``target_top1=null``) once per seed (seed-major, so drift spreads over
all of them), then short step-time runs of the sparse rungs,
sparse from the start (on a short schedule their runs are mostly dense warm-up), with `allreduce`'s beside
them (their compute-only reference), and the same again with the links unshaped (what is left
without the link's rate); (5) short step-time runs of every rung at
the other world sizes, for the scaling model's check (the peers are not rungs: the model is checked
against their runs; without `allreduce` among the rungs there is no check and no step-time run);
(6) write the report (``reproduction.report``) and the runs' rows of
``results/runs.csv`` (``runs.run_row``). Our
algorithms switch from recursive doubling to the ring where the model prices the network measured at
that world size (``netbench.small_message_kb``). With root every rank runs in its own network
namespace behind a rate-limited link (``cluster.netemu``); without, on loopback, and the report says
so. Every job's completion is saved as it happens (``Progress``): an interrupted reproduction,
launched again with the same plan and code, continues."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

from gradientflow_repro import REPO, render
from gradientflow_repro.cluster import netemu
from gradientflow_repro.cluster.launch import network, run_ranks
from gradientflow_repro.comm import knobs
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.config import compose
from gradientflow_repro.provenance import code_version, environment_facts
from gradientflow_repro.reproduction import lineup
from gradientflow_repro.reproduction.progress import MACHINE_KEYS, Progress, Timeline
from gradientflow_repro.reproduction.report import write_report
from gradientflow_repro.reproduction.runs import (
    compute_only_s,
    load_run,
    median_step,
    read_runs_csv,
    run_row,
    run_target,
    steady_step,
    update_runs_csv,
    with_target,
)
from gradientflow_repro.scaling import perfmodel
from gradientflow_repro.scaling.netbench import measure_network, small_message_kb
from gradientflow_repro.tracking import duration

log = logging.getLogger(__name__)

# Dense fp32 ring traffic time over compute time per step, for AlexNet on the paper's cluster
PAPER_RATIO, PAPER_RATIO_ARITHMETIC = perfmodel.paper_dense_ratio()
# Per experiment, overrides for every run of the comparison (none today: digits_cpu's recipe is the
# comparison's, chosen for it; docs/configuration.md).
EXPERIMENT_OVERRIDES: dict[str, list[str]] = {}
# Per experiment, the configurations trained by default (``--rungs`` overrides; an experiment not
# named: every one of ``lineup.COMPARED``). patterns_cpu: a run of its 1,000 steps takes minutes on the
# emulated network, so three seeds of every configuration would take hours; these are the paper's
# comparison: dense DDP, what researchers would use instead (PyTorch's fp16 and PowerSGD hooks), our
# full stack and the paper's as published. `make convergence` trains the others (loopback).
DEFAULT_RUNGS: dict[str, tuple[str, ...]] = {
    "patterns_cpu": ("ddp", "ddp-fp16", "powersgd", "gradientflow", "gradientflow-paper"),
}
RUNS_DIR = render.RUNS / "reproduce"
REPORT = render.output_dir("reproduce", report=False) / "REPORT.md"  # (``--report``: results/REPORT.md)


def machine_overrides(overrides: Sequence[str], program: Optional[str] = None) -> list[str]:
    """Overrides this machine needs for every run of a study: ``precision=fp32`` where the runs (Hydra
    ``overrides``, the experiment among them) train under bf16 autocast on a CPU that only emulates
    bf16 (``precision.native_bf16``), since there bf16 makes each step many times slower, the link
    rate follows the compute down, and the comparison takes hours instead of minutes; nothing where
    the overrides choose a precision (asked for by name, it is what runs). With ``program``, a line
    that it adapts the runs is logged under that name."""
    import torch

    from gradientflow_repro.precision import native_bf16

    if native_bf16(torch.device("cpu")) or any(o.lstrip("+").split("=")[0].split(".")[0] == "precision"
                                               for o in overrides):
        return []  # before composing: the common case costs nothing
    cfg = compose(overrides)
    on_cpu = cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())
    if cfg.precision.dtype != "bf16" or not on_cpu:
        return []
    if program:
        log.info(f"{program}: this CPU emulates bf16 (no AVX-512 BF16 or AMX): every run trains with precision=fp32 "
                 f"(bf16 would take many times as long here)")
    return ["precision=fp32"]


def default_rungs(experiment: str) -> list[str]:
    """The configurations ``make reproduce`` trains for ``experiment`` unless told (``DEFAULT_RUNGS``)."""
    return list(DEFAULT_RUNGS.get(experiment, tuple(lineup.COMPARED)))


def report_target(experiment: str, overrides: Sequence[str]) -> Optional[float]:
    """The top-1 target the runs are measured against (MLPerf's criterion): the experiment's, or the
    one the overrides set. The runs themselves never stop at it (``target_top1=null``), so that the
    same runs also give the paper's criterion, the whole schedule."""
    return compose([f"+experiment={experiment}", *EXPERIMENT_OVERRIDES.get(experiment, []),
                    *overrides]).target_top1


def ladder_overrides(label: str, small_message_kb: Optional[int] = None) -> list[str]:
    """The Hydra overrides of one compared configuration (``comm=NAME comm.KEY=VALUE``), on a network
    whose switch-over to the ring is ``small_message_kb`` (``knobs.on_network``)."""
    return knobs.hydra_overrides(knobs.on_network(lineup.COMPARED[label], small_message_kb))


class Job(NamedTuple):
    """One job of a reproduction."""

    kind: str  # calibration | netbench | train | check
    key: str  # what the time estimate groups it by (``Timeline``)
    name: str  # its name in progress.json


def calibration_job() -> Job:
    return Job("calibration", "calibration", "calibration")


def netbench_job(world: int) -> Job:
    return Job("netbench", str(world), f"netbench w{world}")


def train_job(label: str, seed: int) -> Job:
    return Job("train", label, f"train {label} seed{seed}")


def check_job(label: str, world: int, repeat: int, unshaped: bool = False) -> Job:
    key = f"{label} w{world}" + (" unshaped" if unshaped else "")
    return Job("check", key, f"check {key} r{repeat}")


DEFAULT_CHECK_WORLDS = (2,)  # the model's check at a second world size (short step-time runs)
# Repeats of the measurements around the ladder: the model's step-time runs per strategy and world
# size (their median; shaped and unshaped) and launches of the network measurement (their mean).
# Three step-time runs each, as many as the seeds: one run's median step moved by up to a fifth on
# two shared cores, enough to fail the model's 15% check alone. They are what a tighter time budget
# trims first (``--check-repeats 1``: the report says so), since the seeds of the runs to the target
# are what the comparison stands on. Two network launches: the model's every prediction rests on
# the network's figures.
CHECK_REPEATS = 3
NETBENCH_LAUNCHES = 2


def sparse_rung(label: str) -> bool:
    """Whether a rung of the ladder sends sparsely after a dense warm-up (CSC below density 1)."""
    return resolve(lineup.COMPARED[label]).sends_sparse


def check_worlds_for(world: int, check_worlds: Optional[Sequence[int]]) -> list[int]:
    """The world sizes of the step-time runs: ``check_worlds`` as given, each once and never the
    ladder's own (its step times come from the ladder's runs, and its sparse rungs' from short runs
    of their own; a second set would replace them), or
    by default ``DEFAULT_CHECK_WORLDS`` without the ladder's."""
    if check_worlds is None:
        return [other for other in DEFAULT_CHECK_WORLDS if other != world]
    if world in check_worlds or len(set(check_worlds)) != len(check_worlds):
        raise ValueError(f"check world sizes {list(check_worlds)}: each once, and not the ladder's world size {world}")
    return list(check_worlds)


def reproduce(*, experiment: str = "patterns_cpu", world: int = 4, check_worlds: Optional[Sequence[int]] = None,
              repeats: int = 3, rungs: Optional[Sequence[str]] = None, rate_mbit: Optional[float] = None,
              emulate: bool = True, runs_dir: Path = RUNS_DIR, report: Path = REPORT, timeout_s: float = 600,
              check_steps: int = 24, check_repeats: int = CHECK_REPEATS, netbench_launches: int = NETBENCH_LAUNCHES,
              overrides: Sequence[str] = (), fresh: bool = False,
              command: str = "python scripts/reproduce.py") -> None:
    """Run the whole comparison into ``runs_dir`` and write ``report``. Repeat r trains every
    configuration with ``seed=r`` (initial weights and data order). ``overrides``: Hydra overrides for
    every run; ``command``: how it was invoked, for the report; ``rungs``: the configurations to train
    (None: ``default_rungs``). Every configuration trains the whole schedule, never stopped at the
    target: the report reads MLPerf's criterion (time to the target) from its evaluations and the
    paper's (the fixed schedule) from its end. An unfinished reproduction of the same plan continues
    (``Progress``); one of another plan raises ``CannotContinue`` unless ``fresh``."""
    check_worlds = check_worlds_for(world, check_worlds)
    report.parent.mkdir(parents=True, exist_ok=True)  # fails now, not after the last run, if it cannot
    rungs = default_rungs(experiment) if rungs is None else list(rungs)
    target = report_target(experiment, overrides)
    # the model checks the speed ladder, scaled to allreduce's compute-only step: without allreduce
    # no step-time run could be checked, so none is planned (the report says so)
    checked = [label for label in rungs if label in lineup.LADDER] if "allreduce" in rungs else []
    check_worlds = check_worlds if checked else []
    # a sparse rung's step time at the ladder's world size comes from short runs sparse from the start,
    # as at the other world sizes (chosen when its runs stopped at the target, mostly dense warm-up;
    # kept for the side-by-side reference below)
    sparse_checked = [label for label in checked if sparse_rung(label)]
    # ... with `allreduce`'s short runs between them: the compute-only step they are set against,
    # measured side by side (this machine's speed drifts over the minutes between the two kinds of run)
    short_checked = ["allreduce", *sparse_checked] if sparse_checked and "allreduce" in checked else sparse_checked
    seeds = list(range(repeats))
    reason = netemu.why_unavailable() if emulate else "disabled by --no-emulation"
    machine = environment_facts()
    plan = {"experiment": experiment, "world": world, "check_worlds": list(check_worlds), "repeats": repeats,
            "rungs": rungs, "rate_mbit": rate_mbit, "emulated": reason is None, "check_steps": check_steps,
            "check_repeats": check_repeats, "netbench_launches": netbench_launches,
            "overrides": list(overrides), "code": code_version(),
            "machine": {key: machine[key] for key in MACHINE_KEYS}}
    with Progress(runs_dir, plan, fresh) as progress:  # saved however the launch ends
        group = progress.state["group"]  # one for all launches
        adapted = machine_overrides([f"+experiment={experiment}", *EXPERIMENT_OVERRIDES.get(experiment, []),
                                     *overrides], program="reproduce")
        base = [f"+experiment={experiment}", "save_final_params=false", f"logger.group={group}",
                "resume=never", *EXPERIMENT_OVERRIDES.get(experiment, []), *adapted, *overrides]
        jobs = [calibration_job(), netbench_job(world), *[train_job(label, seed) for seed in seeds for label in rungs],
                *[check_job(label, world, repeat + 1) for repeat in range(check_repeats) for label in short_checked],
                *[check_job(label, world, repeat + 1, unshaped=True) for repeat in range(check_repeats)
                  for label in short_checked if reason is None],
                *[job for other in check_worlds for job in
                  [netbench_job(other), *[check_job(label, other, repeat + 1)
                                          for repeat in range(check_repeats) for label in checked]]]]
        log.info(f"reproduce: {len(rungs)} configurations x {repeats} seeds at world size {world}; "
                 f"network: {'emulated (namespaces + tbf)' if reason is None else 'loopback (' + reason + ')'}")
        if progress.kept:
            log.info(f"reproduce: continuing the interrupted reproduction in {runs_dir} (launch "
                     f"{len(progress.state['launches'])}): {progress.kept} of {len(jobs)} jobs done before, kept")
        timeline = Timeline([(job.kind, job.key) for job in jobs if progress.done(job.name) is None])

        def begin(job: Job, title: str, out: Path) -> bool:
            """Begin ``job`` unless an earlier launch finished it (then False); ``out`` starts empty."""
            if progress.done(job.name) is not None:
                return False
            timeline.begin(job.kind, job.key, title)
            shutil.rmtree(out, ignore_errors=True)  # what a cut-short launch of this job left
            return True

        # (1)-(3) calibration, rate, network measurement
        if begin(calibration_job(), "calibration: compute and bytes per step, profile", runs_dir / "calibration"):
            with network(world, None, reason) as net:
                progress.record(calibration_job().name, calibrate(world, base, runs_dir / "calibration", net,
                                                                  timeout_s))
        calibration = progress.done(calibration_job().name)
        rate = rate_mbit or calibration["bytes_per_step"] * 8 / 1e6 / (PAPER_RATIO * calibration["compute_s"])
        rate = round(rate, 1)
        log.info(f"reproduce: compute {calibration['compute_s'] * 1e3:.1f} ms/step, "
                 f"{calibration['bytes_per_step'] / 1e6:.2f} MB sent per rank per step (allreduce, fp32) -> "
                 f"link rate {rate} Mbit/s "
                 f"{'(chosen for comm/compute = %.2f)' % PAPER_RATIO if not rate_mbit else '(given)'}")

        gradients = [tensor[0] for tensor in calibration["profile"]["tensors"]]  # (elements, ready, flat[, rows])

        def trained(job: Job, title: str, run_dir: Path, launch_ranks: Callable[[], None]) -> dict:
            """``job``'s run in ``run_dir`` (``load_run``), trained by ``launch_ranks`` unless an
            earlier launch finished it."""
            if not begin(job, title, run_dir):
                return load_run(run_dir)
            launch_ranks()
            run = load_run(run_dir)  # readable before it counts as done
            progress.record(job.name)
            return run

        def measured_network(other: int, net: Optional[netemu.EmulatedNetwork], out: Path) -> dict:
            if begin(netbench_job(other), f"network measurement at world size {other}", out):
                figures = measure_network(other, net, out, timeout_s, gradients, netbench_launches)
                progress.record(netbench_job(other).name, {
                    "emulated": reason is None, "why_not": reason, "rate_mbit": rate if reason is None else None,
                    # on loopback the default was measured for just that network
                    **figures, "small_message_kb": small_message_kb(other, figures) if reason is None else None})
            return progress.done(netbench_job(other).name)

        def step_time_runs(other: int, labels: list[str], net: Optional[netemu.EmulatedNetwork],
                           unshaped: bool = False) -> dict[str, dict]:
            """Each of ``labels``' median step over ``check_repeats`` short runs at world size ``other``,
            sparse from the start (``runs.median_step``); ``unshaped``: on links without a rate (the
            same switch-over as on the shaped ones: only the wire time differs)."""
            short: dict[str, list[dict]] = {label: [] for label in labels}
            switch = network_by_world[other]["small_message_kb"]
            where = " on unshaped links" if unshaped else ""
            for repeat in range(1, check_repeats + 1):  # repeat-major, as the ladder
                for label in labels:
                    run_dir = runs_dir / f"check-world{other}{'-unshaped' if unshaped else ''}" / label / f"r{repeat}"
                    short[label].append(trained(
                        check_job(label, other, repeat, unshaped),
                        f"[{label}] step-time run {repeat}/{check_repeats} at world size {other}{where}", run_dir,
                        lambda: run_ranks(other, [*base, *ladder_overrides(label, switch), f"run_dir={run_dir}",
                                                  f"max_steps={check_steps}", "comm.csc_warmup_epochs=0",
                                                  "logger=jsonl", "logger.log_every=4"],
                                          run_dir, f"{label} w{other}{where}", net, timeout_s, show=False)))
            return {label: median_step(short[label], skip_warmup=False) for label in labels}

        runs: dict[str, list[dict]] = {label: [] for label in rungs}
        checks: dict[int, dict[str, dict]] = {}
        with network(world, rate, reason) as net:
            measured = measured_network(world, net, runs_dir / "netbench")
            network_by_world = {world: measured}
            switch = measured["small_message_kb"]
            log.info(f"reproduce: measured link {measured['bandwidth_Bps'] / 1e6:.1f} MB/s, per-message latency "
                     f"{measured['latency_s'] * 1e6:.0f} us" + (f": our algorithms send messages of up to {switch} KiB "
                                                               "by recursive doubling, larger ones by the ring"
                                                               if switch else ""))
            for index, seed in enumerate(seeds):  # (4) every configuration, seed-major
                for label in rungs:  # (so drift spreads over all of them)
                    run_dir = runs_dir / label / f"seed{seed}"
                    runs[label].append(trained(
                        train_job(label, seed), f"[{label}] seed {seed} ({index + 1} of {repeats})", run_dir,
                        lambda: run_ranks(world, [*base, *ladder_overrides(label, switch), "target_top1=null",
                                                  f"seed={seed}", f"run_dir={run_dir}", f"logger.name={label}"],
                                          run_dir, f"{label} s{seed}", net, timeout_s)))
            short_steps = step_time_runs(world, short_checked, net)
            checks[world] = {label: short_steps[label] if label in sparse_checked else median_step(runs[label])
                             for label in checked}
            beside = {world: short_steps["allreduce"]} if short_checked != sparse_checked else {}
        unshaped: dict[int, dict[str, dict]] = {}
        if reason is None and sparse_checked:  # the same short runs without the link's rate (loopback has none)
            with network(world, None, reason) as net:
                unshaped[world] = step_time_runs(world, short_checked, net, unshaped=True)
        for other in check_worlds:  # (5) step times at other world sizes, on a network measured there
            with network(other, rate, reason) as net:
                network_by_world[other] = measured_network(other, net, runs_dir / f"netbench-world{other}")
                checks[other] = step_time_runs(other, checked, net)
        timeline.end()

        facts = {"checks": checks, "calibration": calibration, "network": measured,
                 "network_by_world": network_by_world, "world": world, "repeats": repeats,
                 "check_repeats": check_repeats, "command": command, "elapsed_s": progress.elapsed_s,
                 "launches": progress.state["launches"], "experiment": experiment, "target_top1": target,
                 "group": group,
                 "overrides": base[1:], "rungs": rungs, "machine": machine, "short_at_world": sparse_checked,
                 "unshaped": unshaped, "allreduce_beside": beside}
        (runs_dir / "reproduce.json").write_text(json.dumps(facts, indent=1))
        report_from(runs_dir, report)
        progress.finish()  # after the report: a launch stopped while writing it keeps every run
        log.info(f"reproduce: wrote {report} in {duration(time.time() - progress.started)}"
                 + (f" ({duration(progress.elapsed_s)} over {len(progress.state['launches'])} launches)"
                    if len(progress.state["launches"]) > 1 else ""))


def report_from(runs_dir: Path, report: Path) -> None:
    """(Re)write the report (and its data, ``.json`` beside it: ``report.write_report``) from a finished
    reproduction's directory (``--report-only``), and the runs' rows of ``runs.csv`` beside it (study
    ``reproduce``; ``make convergence``'s rows are kept, and the report reads their top-1 at the end)."""
    facts = json.loads((runs_dir / "reproduce.json").read_text())
    runs = {label: [measured_against(load_run(d), facts)
                    for d in sorted((runs_dir / label).glob("seed*"), key=lambda d: int(d.name[4:]))]
            for label in facts.pop("rungs")}
    facts.pop("target_top1", None)  # now each run's (``measured_against``)
    table = report.parent / "runs.csv"
    update_runs_csv(table, "reproduce", [run_row(run, study="reproduce", label=label, target=run_target(run))
                                         for label, items in runs.items() for run in items])
    facts["convergence_rows"] = read_runs_csv(table, "convergence")
    facts["convergence_source"] = (f"`{table.resolve().relative_to(REPO).as_posix()}`"
                                   if table.resolve().is_relative_to(REPO) else "`runs.csv` beside this report")
    facts["checks"] = {int(world): value for world, value in facts["checks"].items()}
    facts["unshaped"] = {int(world): value for world, value in facts.get("unshaped", {}).items()}
    facts["allreduce_beside"] = {int(world): value for world, value in facts.get("allreduce_beside", {}).items()}
    facts["network_by_world"] = {int(world): value for world, value in facts.get("network_by_world", {}).items()}
    write_report(report, runs=runs, written_by=environment_facts()["git_commit"], **facts)


def measured_against(run: dict, facts: dict) -> dict:
    """``run`` with the reproduction's target (``runs.with_target``); a reproduction from before the
    runs trained the whole schedule names none, and its runs keep the one they stopped at."""
    return with_target(run, facts["target_top1"]) if "target_top1" in facts else run


def calibrate(world: int, base: list[str], run_dir: Path, net: Optional[netemu.EmulatedNetwork],
              timeout_s: float) -> dict:
    """Compute time and bytes per step of the baseline on an unshaped network, and the model's
    measured single-process profile (for the scaling model)."""
    run_ranks(world, [*base, *ladder_overrides("allreduce"), f"run_dir={run_dir}", "max_steps=20",
                      "logger=jsonl", "logger.log_every=4"], run_dir, "calibration", net, timeout_s, show=False)
    step = steady_step(load_run(run_dir))
    profile_file = run_dir / "profile.json"
    subprocess.run([sys.executable, "-m", "gradientflow_repro.scaling.profile", str(profile_file), "--",
                    *[o for o in base if not o.startswith("logger.")]], cwd=REPO, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PROFILE_WORLD": str(world)}, timeout=timeout_s)
    return {"compute_s": compute_only_s(step), "bytes_per_step": step["bytes_per_step"],
            "step_s": step["step_s"], "profile": json.loads(profile_file.read_text())}
