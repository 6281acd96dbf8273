"""The paper's comparison on one machine: the ablation ladder, each rung trained to the target
accuracy over an emulated cluster network once per seed, then results/REPORT.md.

Steps: (1) calibrate: profile the model (``harness.profile``), run the baseline briefly on an
unshaped network to get compute time and bytes per step; (2) choose the link rate that gives the
paper's dense communication/computation ratio; (3) measure the shaped network's bandwidth and
per-message latency (``harness.netbench``); (4) train every rung of the ladder (``knobs.LADDER``),
and gradientflow's variants for convergence (``knobs.SPARSE_VARIANTS``), to the target once per seed
(seed-major, so drift spreads over all of them); (5) short step-time runs at the
other world sizes for the scaling model's check; (6) write the report (``harness.report``). With
root every rank runs in its own network namespace behind a rate-limited link (``harness.netemu``);
without, on loopback, and the report says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from gradientflow_repro import perfmodel
from gradientflow_repro.comm import knobs
from gradientflow_repro.harness import REPO, netemu
from gradientflow_repro.harness.launch import network, run_ranks
from gradientflow_repro.harness.netbench import measure_network
from gradientflow_repro.harness.report import write_report
from gradientflow_repro.harness.runs import load_run, median_step, steady_step
from gradientflow_repro.tracking import duration, environment_facts

# Dense fp32 ring traffic time over compute time per step, for AlexNet on the paper's cluster
PAPER_RATIO, PAPER_RATIO_ARITHMETIC = perfmodel.paper_dense_ratio()
# Per experiment, overrides for every run of the comparison (none today: digits_cpu's recipe is the
# comparison's, chosen for it; README, "Where the numbers come from").
EXPERIMENT_OVERRIDES: dict[str, list[str]] = {}
RUNS_DIR = REPO / "results" / "runs" / "reproduce"
REPORT = REPO / "results" / "REPORT.md"


def ladder_overrides(label: str) -> list[str]:
    """The Hydra overrides of one compared configuration (``comm=NAME comm.KEY=VALUE``)."""
    return knobs.hydra_overrides(knobs.COMPARED[label])


class Timeline:
    """The whole reproduction as a list of jobs known in advance: before each one it prints which job
    of how many it is, the time so far and an estimate of the time left (each job left costs what
    jobs of the same key took, else jobs of the same kind, else ``GUESS_S`` of its kind)."""

    GUESS_S = {"calibration": 40.0, "netbench": 40.0, "train": 30.0, "check": 12.0}

    def __init__(self, jobs: list[tuple[str, str]], name: str = "reproduce") -> None:
        self.jobs = jobs  # (kind, key) in the order they run
        self.name = name  # what the progress lines begin with
        self.done: list[tuple[str, str, float]] = []
        self.started = time.time()
        self._current: Optional[tuple[str, str, float]] = None

    def _estimate(self, kind: str, key: str) -> float:
        for match in (lambda k, c: (k, c) == (kind, key), lambda k, c: k == kind):
            took = [s for k, c, s in self.done if match(k, c)]
            if took:
                return sum(took) / len(took)
        return self.GUESS_S[kind]

    def begin(self, kind: str, key: str, title: str) -> None:
        self.end()
        index = len(self.done)
        if index < len(self.jobs) and self.jobs[index] == (kind, key):
            left = sum(self._estimate(k, c) for k, c in self.jobs[index:])
        else:  # a display's mistake must not stop a reproduction: say so, estimate nothing
            print(f"{self.name}: job {index + 1} ({kind} {key}) was not planned there: time left unknown", flush=True)
            left = float("nan")
        print(f"{self.name}: [{index + 1}/{len(self.jobs)}] {title} | {duration(time.time() - self.started)} so far, "
              f"about {duration(left)} left", flush=True)
        self._current = (kind, key, time.time())

    def end(self) -> None:
        if self._current:
            kind, key, began = self._current
            self.done.append((kind, key, time.time() - began))
            self._current = None


def reproduce(*, experiment: str = "digits_cpu", world: int = 4, check_worlds: Sequence[int] = (2,),
              repeats: int = 3, rungs: Sequence[str] = tuple(knobs.COMPARED), rate_mbit: Optional[float] = None,
              emulate: bool = True, runs_dir: Path = RUNS_DIR, report: Path = REPORT, timeout_s: float = 600,
              check_steps: int = 24, check_repeats: int = 3, netbench_launches: int = 3,
              overrides: Sequence[str] = (), command: str = "python scripts/reproduce.py") -> None:
    """Run the whole comparison into ``runs_dir`` (emptied first) and write ``report``. Repeat r
    trains every configuration with ``seed=r`` (initial weights and data order). ``overrides``: Hydra
    overrides for every run; ``command``: how it was invoked, for the report."""
    started = time.time()
    rungs = list(rungs)
    checked = [label for label in rungs if label in knobs.LADDER]  # the model checks the speed ladder
    seeds = list(range(repeats))
    shutil.rmtree(runs_dir, ignore_errors=True)  # a reproduction is one fresh set of runs
    runs_dir.mkdir(parents=True)
    reason = netemu.why_unavailable() if emulate else "disabled by --no-emulation"
    group = f"reproduce-{time.strftime('%Y%m%d-%H%M%S')}"
    base = [f"+experiment={experiment}", "save_final_params=false", f"logger.group={group}",
            "resume=never", *EXPERIMENT_OVERRIDES.get(experiment, []), *overrides]
    print(f"reproduce: {len(rungs)} configurations x {repeats} seeds at world size {world}; "
          f"network: {'emulated (namespaces + tbf)' if reason is None else 'loopback (' + reason + ')'}",
          flush=True)
    timeline = Timeline([("calibration", "calibration"), ("netbench", str(world)),
                         *[("train", label) for _ in seeds for label in rungs],
                         *[job for other in check_worlds for job in
                           [("netbench", str(other)), *[("check", f"{label} w{other}")
                                                        for _ in range(check_repeats) for label in checked]]]])

    # (1)-(3) calibration, rate, network measurement
    timeline.begin("calibration", "calibration", "calibration: compute and bytes per step, profile")
    with network(world, None, reason) as net:
        calibration = calibrate(world, base, runs_dir / "calibration", net, timeout_s)
    rate = rate_mbit or calibration["bytes_per_step"] * 8 / 1e6 / (PAPER_RATIO * calibration["compute_s"])
    rate = round(rate, 1)
    print(f"reproduce: compute {calibration['compute_s'] * 1e3:.1f} ms/step, {calibration['bytes_per_step'] / 1e6:.2f} "
          f"MB sent per rank per step (allreduce, fp32) -> link rate {rate} Mbit/s "
          f"{'(chosen for comm/compute = %.2f)' % PAPER_RATIO if not rate_mbit else '(given)'}", flush=True)

    gradients = [elements for elements, _, _ in calibration["profile"]["tensors"]]
    runs: dict[str, list[dict]] = {label: [] for label in rungs}
    checks: dict[int, dict[str, dict]] = {}
    measured: dict = {"emulated": reason is None, "why_not": reason, "rate_mbit": rate if reason is None else None}
    with network(world, rate, reason) as net:
        timeline.begin("netbench", str(world), f"network measurement at world size {world}")
        measured.update(measure_network(world, net, runs_dir / "netbench", timeout_s, gradients, netbench_launches))
        network_by_world = {world: measured}
        print(f"reproduce: measured link {measured['bandwidth_Bps'] / 1e6:.1f} MB/s, per-message latency "
              f"{measured['latency_s'] * 1e6:.0f} us", flush=True)
        for index, seed in enumerate(seeds):  # (4) every configuration to the target, seed-major
            for label in rungs:  # (so drift spreads over all of them)
                run_dir = runs_dir / label / f"seed{seed}"
                timeline.begin("train", label, f"[{label}] seed {seed} ({index + 1} of {repeats})")
                run_ranks(world, [*base, *ladder_overrides(label), f"seed={seed}", f"run_dir={run_dir}",
                                  f"logger.name={label}"], run_dir, f"{label} s{seed}", net, timeout_s)
                runs[label].append(load_run(run_dir))
        checks[world] = {label: median_step(runs[label]) for label in checked}
    for other in check_worlds:  # (5) step times at other world sizes, on a network measured there
        with network(other, rate, reason) as net:
            timeline.begin("netbench", str(other), f"network measurement at world size {other}")
            network_by_world[other] = measure_network(other, net, runs_dir / f"netbench-world{other}",
                                                      timeout_s, gradients, netbench_launches)
            short: dict[str, list[dict]] = {label: [] for label in checked}
            for repeat in range(check_repeats):  # repeat-major, as the ladder
                for label in checked:
                    run_dir = runs_dir / f"check-world{other}" / label / f"r{repeat + 1}"
                    timeline.begin("check", f"{label} w{other}", f"[{label}] step-time run {repeat + 1}/"
                                   f"{check_repeats} at world size {other}")
                    run_ranks(other, [*base, *ladder_overrides(label), f"run_dir={run_dir}",
                                      f"max_steps={check_steps}", "comm.csc_warmup_epochs=0", "logger=jsonl",
                                      "logger.log_every=4"],
                              run_dir, f"{label} w{other}", net, timeout_s, show=False)
                    short[label].append(load_run(run_dir))
            checks[other] = {label: median_step(short[label], skip_warmup=False) for label in checked}
    timeline.end()

    facts = {"checks": checks, "calibration": calibration, "network": measured,
             "network_by_world": network_by_world, "world": world, "repeats": repeats,
             "check_repeats": check_repeats, "command": command, "elapsed_s": time.time() - started,
             "experiment": experiment, "group": group, "overrides": base[1:], "rungs": rungs,
             "machine": environment_facts()}
    (runs_dir / "reproduce.json").write_text(json.dumps(facts, indent=1))
    report_from(runs_dir, report)
    print(f"reproduce: wrote {report} in {duration(time.time() - started)}", flush=True)


def report_from(runs_dir: Path, report: Path) -> None:
    """(Re)write the report from a finished reproduction's directory (``--report-only``)."""
    facts = json.loads((runs_dir / "reproduce.json").read_text())
    runs = {label: [load_run(d) for d in sorted((runs_dir / label).glob("seed*"), key=lambda d: int(d.name[4:]))]
            for label in facts.pop("rungs")}
    facts["checks"] = {int(world): value for world, value in facts["checks"].items()}
    facts["network_by_world"] = {int(world): value for world, value in facts.get("network_by_world", {}).items()}
    write_report(report, runs=runs, **facts)


def calibrate(world: int, base: list[str], run_dir: Path, net: Optional[netemu.EmulatedNetwork],
              timeout_s: float) -> dict:
    """Compute time and bytes per step of the baseline on an unshaped network, and the model's
    measured single-process profile (for the scaling model)."""
    run_ranks(world, [*base, *ladder_overrides("allreduce"), f"run_dir={run_dir}", "max_steps=20",
                      "logger=jsonl", "logger.log_every=4"], run_dir, "calibration", net, timeout_s, show=False)
    step = steady_step(load_run(run_dir))
    profile_file = run_dir / "profile.json"
    subprocess.run([sys.executable, "-m", "gradientflow_repro.harness.profile", str(profile_file), "--",
                    *[o for o in base if not o.startswith("logger.")]], cwd=REPO, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PROFILE_WORLD": str(world)}, timeout=timeout_s)
    return {"compute_s": step["step_s"] - step["sync_wait_s"], "bytes_per_step": step["bytes_per_step"],
            "step_s": step["step_s"], "profile": json.loads(profile_file.read_text())}
