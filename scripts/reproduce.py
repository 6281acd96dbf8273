#!/usr/bin/env python3
"""The paper's comparison on one machine: the ablation ladder, each rung trained to the target
accuracy over an emulated cluster network, repeated, then results/REPORT.md.

    python scripts/reproduce.py                          # what `make reproduce` runs
    python scripts/reproduce.py --repeats 1 --rungs allreduce gradientflow -- max_steps=40

Steps: (1) calibrate: profile the model, run the baseline briefly on an unshaped network to get
compute time and bytes per step; (2) choose the link rate that gives the paper's dense
communication/computation ratio; (3) measure the shaped network's bandwidth and per-message
latency; (4) train every rung of the ladder ``--repeats`` times (repeat-major, so drift spreads
over all rungs); (5) short step-time runs at the other world size for the scaling model's check;
(6) write the report (scripts/report.py does the writing; scripts/simulate_scaling.py the paper
check). With root every rank runs in its own network namespace behind a rate-limited link
(gradientflow_repro/netemu.py); without, on loopback, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gradientflow_repro import netemu, perfmodel  # noqa: E402
from gradientflow_repro.tracking import environment_facts, read_records  # noqa: E402

# (label, Hydra overrides): each rung adds one of the paper's techniques
LADDER = {
    "allreduce": ["comm=allreduce"],
    "ddp": ["comm=ddp"],
    "ring": ["comm=ring"],
    "ring+fp16": ["comm=ring", "comm.wire=fp16"],
    "ring+fp16+lazy": ["comm=lazy", "comm.wire=fp16"],
    "gradientflow": ["comm=gradientflow"],
}
sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import write_report  # noqa: E402

# Dense fp32 ring traffic time over compute time per step, for AlexNet on the paper's cluster
PAPER_RATIO, PAPER_RATIO_ARITHMETIC = perfmodel.paper_dense_ratio()
NETBENCH = ("scripts/reproduce.py", "--netbench")
# Per experiment, overrides for every run of the comparison: digits_cpu's learning rate decays over
# 20 epochs instead of 40, so the target comes at about epoch 16 instead of 24 and the 18 runs fit
# in about 20 minutes on two cores (the same schedule for every strategy).
EXPERIMENT_OVERRIDES = {"digits_cpu": ["epochs=20"]}


def run_ranks(world: int, overrides: list[str], run_dir: Path, label: str,
              net: Optional[netemu.EmulatedNetwork], timeout_s: float, show: bool = True,
              module: tuple[str, ...] = ("-m", "gradientflow_repro.train")) -> None:
    """Start ``world`` ranks (in the emulated network or on loopback), stream rank 0's output with
    a prefix, keep the others' in files, and fail with their tails if any rank fails."""
    run_dir.mkdir(parents=True, exist_ok=True)
    port = 29400 + (os.getpid() + int(time.time())) % 2000
    master = net.address(0) if net else "127.0.0.1"
    logs, processes = [], []
    for rank in range(world):
        # every rank runs on this machine: its local rank is its rank (with device=cuda, its GPU)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": master, "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
               "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, *module, *overrides]
        log = open(run_dir / f"rank{rank}.log", "w")
        logs.append(log)
        stdout = subprocess.PIPE if rank == 0 else log
        if net:
            processes.append(net.launch(rank, argv, env, stdout, cwd=REPO))
        else:
            processes.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=stdout, text=True,
                                              stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout_s
    stop = threading.Event()

    def watchdog() -> None:  # a failed rank or the deadline ends every rank: nothing waits forever
        while not stop.wait(0.2):
            failed = any(p.poll() not in (None, 0) for p in processes)
            if failed or time.monotonic() > deadline:
                for process in processes:
                    netemu.kill_group(process, grace_s=2.0)
                return

    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    try:
        for line in processes[0].stdout:  # rank 0's progress, as it comes
            logs[0].write(line)
            if show and (line.startswith("[") and not line.startswith("[W") or "error" in line.lower()):
                print(f"  {label:>15} | {line.rstrip()}", flush=True)
        codes = [process.wait() for process in processes]
        stop.set()
        if any(code != 0 for code in codes):
            for log in logs:
                log.flush()
            tails = "\n".join(f"--- rank {r} (exit {c}) ---\n" + _tail(run_dir / f"rank{r}.log")
                              for r, c in enumerate(codes) if c != 0)
            raise RuntimeError(f"{label}: ranks failed or timed out after {timeout_s:.0f}s "
                               f"(exit codes {codes}):\n{tails}")
    finally:
        stop.set()
        for process in processes:
            netemu.kill_group(process)
        for log in logs:
            log.close()


def _tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def load_run(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"summary": summary, "records": read_records(run_dir / "metrics.jsonl")}


def steady_step(run: dict, after_epoch: float = 0.0) -> dict[str, float]:
    """Median step time and synchronize wait over the logged intervals (after ``after_epoch``)."""
    train = [r for r in run["records"] if r["kind"] == "train" and r["epoch"] > after_epoch]
    train = train or [r for r in run["records"] if r["kind"] == "train"]
    if not train:  # ended before its first progress line: the run's averages
        s = run["summary"]
        return {"step_s": s["train_s"] / max(1, s["steps"]), "sync_wait_s": s["sync_wait_s_per_step"],
                "bytes_per_step": s["bytes_per_step"]}
    return {"step_s": statistics.median(r["step_s"] for r in train),
            "sync_wait_s": statistics.median(r["sync_wait_s_per_step"] for r in train),
            "bytes_per_step": statistics.median(r["bytes_per_step"] for r in train)}


def median_step(repeats: list[dict], skip_warmup: bool = True) -> dict:
    """``steady_step`` of each repeat of one strategy (after CSC's dense warm-up if
    ``skip_warmup``): the median of each figure, and every repeat's step time (``step_s_each``)."""
    steps = [steady_step(run, _warmup(run) if skip_warmup else 0.0) for run in repeats]
    return {**{key: statistics.median(step[key] for step in steps) for key in steps[0]},
            "step_s_each": [step["step_s"] for step in steps]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiment", default="digits_cpu")
    parser.add_argument("--world", type=int, default=4, help="ranks for the time-to-accuracy ladder")
    parser.add_argument("--check-world", type=int, nargs="*", default=[2],
                        help="extra world sizes with short step-time runs for the scaling model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rungs", nargs="+", default=list(LADDER), choices=list(LADDER))
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="link rate; default: chosen to match the paper's comm/compute ratio")
    parser.add_argument("--no-emulation", action="store_true", help="loopback even as root")
    parser.add_argument("--runs-dir", type=Path, default=REPO / "results" / "runs" / "reproduce")
    parser.add_argument("--report", type=Path, default=REPO / "results" / "REPORT.md")
    parser.add_argument("--timeout-s", type=float, default=600, help="per training run")
    parser.add_argument("--check-steps", type=int, default=24, help="steps of each step-time run")
    parser.add_argument("--check-repeats", type=int, default=3, help="step-time runs per strategy and world size")
    parser.add_argument("--netbench-launches", type=int, default=3,
                        help="launches of the network measurement per world size (figures are averaged)")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite the report from the runs of the last reproduction, run nothing")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    started = time.time()
    if args.report_only:
        report_from(args.runs_dir, args.report)
        return

    import shutil

    shutil.rmtree(args.runs_dir, ignore_errors=True)  # a reproduction is one fresh set of runs
    args.runs_dir.mkdir(parents=True)
    reason = "disabled by --no-emulation" if args.no_emulation else netemu.why_unavailable()
    group = f"reproduce-{time.strftime('%Y%m%d-%H%M%S')}"
    base = [f"+experiment={args.experiment}", "save_final_params=false", f"logger.group={group}",
            "resume=never", *EXPERIMENT_OVERRIDES.get(args.experiment, []), *args.overrides]
    print(f"reproduce: {len(args.rungs)} strategies x {args.repeats} repeats at world size {args.world}; "
          f"network: {'emulated (namespaces + tbf)' if reason is None else 'loopback (' + reason + ')'}",
          flush=True)

    # (1)-(3) calibration, rate, network measurement
    with _network(args.world, None, reason) as net:
        calibration = calibrate(args.world, base, args.runs_dir / "calibration", net, args.timeout_s)
    rate = args.rate_mbit or calibration["bytes_per_step"] * 8 / 1e6 / (PAPER_RATIO * calibration["compute_s"])
    rate = round(rate, 1)
    print(f"reproduce: compute {calibration['compute_s'] * 1e3:.1f} ms/step, {calibration['bytes_per_step'] / 1e6:.2f} "
          f"MB sent per rank per step (allreduce, fp32) -> link rate {rate} Mbit/s "
          f"{'(chosen for comm/compute = %.2f)' % PAPER_RATIO if not args.rate_mbit else '(given)'}", flush=True)

    gradients = [elements for elements, _, _ in calibration["profile"]["tensors"]]
    runs: dict[str, list[dict]] = {label: [] for label in args.rungs}
    checks: dict[int, dict[str, dict]] = {}
    network: dict = {"emulated": reason is None, "why_not": reason, "rate_mbit": rate if reason is None else None}
    with _network(args.world, rate, reason) as net:
        network.update(measure_network(args.world, net, args.runs_dir / "netbench", args.timeout_s, gradients,
                                       args.netbench_launches))
        network_by_world = {args.world: network}
        print(f"reproduce: measured link {network['bandwidth_Bps'] / 1e6:.1f} MB/s, per-message latency "
              f"{network['latency_s'] * 1e6:.0f} us", flush=True)
        for repeat in range(args.repeats):  # (4) the ladder, repeat-major
            for label in args.rungs:
                run_dir = args.runs_dir / label / f"r{repeat + 1}"
                print(f"reproduce: [{label}] run {repeat + 1}/{args.repeats} "
                      f"({time.time() - started:.0f}s elapsed)", flush=True)
                run_ranks(args.world, [*base, *LADDER[label], f"run_dir={run_dir}", f"logger.name={label}"],
                          run_dir, f"{label} r{repeat + 1}", net, args.timeout_s)
                runs[label].append(load_run(run_dir))
        checks[args.world] = {label: median_step(runs[label]) for label in args.rungs}
    for world in args.check_world:  # (5) step times at other world sizes, on a network measured there
        with _network(world, rate, reason) as net:
            network_by_world[world] = measure_network(world, net, args.runs_dir / f"netbench-world{world}",
                                                      args.timeout_s, gradients, args.netbench_launches)
            repeats: dict[str, list[dict]] = {label: [] for label in args.rungs}
            for repeat in range(args.check_repeats):  # repeat-major, as the ladder
                for label in args.rungs:
                    run_dir = args.runs_dir / f"check-world{world}" / label / f"r{repeat + 1}"
                    print(f"reproduce: [{label}] step-time run {repeat + 1}/{args.check_repeats} at world "
                          f"size {world}", flush=True)
                    run_ranks(world, [*base, *LADDER[label], f"run_dir={run_dir}", f"max_steps={args.check_steps}",
                                      "comm.csc_warmup_epochs=0", "logger=jsonl", "logger.log_every=4"],
                              run_dir, f"{label} w{world}", net, args.timeout_s, show=False)
                    repeats[label].append(load_run(run_dir))
            checks[world] = {label: median_step(repeats[label], skip_warmup=False) for label in args.rungs}

    facts = {"checks": checks, "calibration": calibration, "network": network,
             "network_by_world": network_by_world, "world": args.world,
             "repeats": args.repeats, "check_repeats": args.check_repeats,
             "command": "python scripts/reproduce.py " + " ".join(sys.argv[1:]),
             "elapsed_s": time.time() - started, "experiment": args.experiment, "group": group,
             "overrides": base[1:], "rungs": args.rungs, "machine": environment_facts()}
    (args.runs_dir / "reproduce.json").write_text(json.dumps(facts, indent=1))
    report_from(args.runs_dir, args.report)
    print(f"reproduce: wrote {args.report} in {time.time() - started:.0f}s", flush=True)


def report_from(runs_dir: Path, report: Path) -> None:
    """(Re)write the report from a finished reproduction's directory (``--report-only``)."""
    facts = json.loads((runs_dir / "reproduce.json").read_text())
    runs = {label: [load_run(d) for d in sorted((runs_dir / label).glob("r*"))] for label in facts.pop("rungs")}
    facts["checks"] = {int(world): value for world, value in facts["checks"].items()}
    facts["network_by_world"] = {int(world): value for world, value in facts.get("network_by_world", {}).items()}
    write_report(report, runs=runs, **facts)


def calibrate(world: int, base: list[str], run_dir: Path, net: Optional[netemu.EmulatedNetwork],
              timeout_s: float) -> dict:
    """Compute time and bytes per step of the baseline on an unshaped network, and the model's
    measured single-process profile (for the scaling model)."""
    run_ranks(world, [*base, "comm=allreduce", f"run_dir={run_dir}", "max_steps=20", "logger=jsonl",
                      "logger.log_every=4"], run_dir, "calibration", net, timeout_s, show=False)
    step = steady_step(load_run(run_dir))
    profile_file = run_dir / "profile.json"
    subprocess.run([sys.executable, __file__, "--profile", str(profile_file), "--",
                    *[o for o in base if not o.startswith("logger.")]], cwd=REPO, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PROFILE_WORLD": str(world)}, timeout=timeout_s)
    return {"compute_s": step["step_s"] - step["sync_wait_s"], "bytes_per_step": step["bytes_per_step"],
            "step_s": step["step_s"], "profile": json.loads(profile_file.read_text())}


def measure_network(world: int, net: Optional[netemu.EmulatedNetwork], run_dir: Path,
                    timeout_s: float, tensor_elements: Sequence[int] = (), launches: int = 3) -> dict:
    """Per-message latency and link bandwidth as the ring sees them, the same for the backend's
    own allreduce, and (given the model's gradient sizes) how long one allreduce per gradient takes
    in isolation, by either. Each figure is the mean over ``launches`` separate launches of the
    ranks (rank 0 writes one JSON per launch): on a shared host the per-message costs differ more
    between launches than between the calls of one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "tensors.json").write_text(json.dumps(list(tensor_elements)))
    measured = []
    for launch in range(launches):
        out = run_dir / f"network{launch + 1}.json"
        run_ranks(world, [str(out), str(run_dir / "tensors.json")], run_dir, "netbench", net, timeout_s,
                  show=False, module=NETBENCH)
        measured.append(json.loads(out.read_text()))
    mean = {key: (None if value is None else
                  [[row[0], statistics.mean(m[key][i][1] for m in measured)] for i, row in enumerate(value)]
                  if isinstance(value, list) else statistics.mean(m[key] for m in measured))
            for key, value in measured[0].items()}
    size = mean.pop("ring_large_bytes")
    latency = mean["tiny_ring_s"] / (2 * (world - 1))
    bandwidth = 2 * (world - 1) / world * size / max(1e-9, mean["ring_large_s"] - 2 * (world - 1) * latency)
    return {**mean, "latency_s": latency, "bandwidth_Bps": bandwidth, "launches": launches}


def _netbench(out: Path, tensors_file: Path) -> None:
    import torch
    import torch.distributed as dist

    from gradientflow_repro.comm.base import CommStats
    from gradientflow_repro.comm.compression import Fp16Wire
    from gradientflow_repro.comm.ring import ring_allreduce_, ring_sum
    from gradientflow_repro.distributed import destroy_process_group_and_exit

    dist.init_process_group("gloo", init_method="env://", timeout=__import__("datetime").timedelta(seconds=120))
    world = dist.get_world_size()

    def timed(tensor, calls: int, allreduce=ring_allreduce_, back_to_back: bool = False) -> float:
        """Mean seconds per call, without the fastest and slowest tenth: a training step pays the
        sum of many calls, and small ones are bimodal when ranks share cores (a rank that is not
        running answers a scheduler slice later), so the median would miss what they cost. Each
        call starts after a barrier, or ``back_to_back`` as a training step issues them (and as
        nccl-tests times them): then a call also pays for the ranks it waits for."""
        allreduce(tensor)
        times = []
        for _ in range(calls):
            if not back_to_back:
                dist.barrier()
            started = time.perf_counter()
            allreduce(tensor)
            times.append(time.perf_counter() - started)
        return _trimmed_mean(times)

    tiny = timed(torch.ones(world), 30)  # one element per rank: latency only
    # a one-value MAX allreduce, as the fp16 wire's shared scale
    builtin_tiny = timed(torch.ones(1), 30, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    size = 8 << 20
    large = timed(torch.ones(size // 4), 15)  # per call bimodal on a shaped link (e.g. 54 or 80 ms at world 2)
    # the backend's own allreduce (the `allreduce` and `ddp` strategies), which need not be a ring:
    # its cost by message size, one element per rank up to past DDP's 25 MiB buckets, back to back
    # as `allreduce` issues one per gradient. Small sizes are dense in the table: with two or more
    # elements per rank gloo's small allreduce takes several times as long as with one.
    builtin_sizes = [4 * world, 64, 256, 1024] + [4096 * 4 ** k for k in range(7)] + [32 << 20]
    builtin_cost = [[nbytes, timed(torch.ones(nbytes // 4), 20 if nbytes < 1 << 20 else 10 if nbytes <= size else 5,
                                   dist.all_reduce, back_to_back=True)] for nbytes in sorted(set(builtin_sizes))]
    # one allreduce per gradient of the model, back to back: what `allreduce`, `ring` and
    # `ring`+fp16 do after backward, without the training around it
    gradients = [torch.randn(n) for n in json.loads(tensors_file.read_text())]
    ring_fp16 = Fp16Wire(ring_sum(), world)
    per_tensor = {name: timed(gradients, 5, lambda tensors, fn=fn: [fn(t) for t in tensors]) if gradients else None
                  for name, fn in (("builtin", dist.all_reduce), ("ring", ring_allreduce_),
                                   ("ring_fp16", lambda t: ring_fp16(t, CommStats())))}
    if dist.get_rank() == 0:
        out.write_text(json.dumps({
            "tiny_allreduce_s": builtin_tiny, "tiny_ring_s": tiny, "ring_large_s": large, "ring_large_bytes": size,
            "builtin_cost_by_size": builtin_cost, "per_tensor_builtin_s": per_tensor["builtin"],
            "per_tensor_ring_s": per_tensor["ring"], "per_tensor_ring_fp16_s": per_tensor["ring_fp16"]}))
    destroy_process_group_and_exit()  # skips finalization: see its docstring


def _trimmed_mean(values: Sequence[float]) -> float:
    """The mean without the lowest and highest tenth (at least one each, from three values on)."""
    ordered = sorted(values)
    cut = max(1, len(ordered) // 10) if len(ordered) >= 3 else 0
    kept = ordered[cut:len(ordered) - cut]
    return sum(kept) / len(kept)


def _profile(out: Path, overrides: list[str]) -> None:
    """The model's per-tensor backward profile in one process, on the per-rank batch."""
    import torch
    from hydra import compose, initialize_config_dir

    from gradientflow_repro.config import register_configs
    from gradientflow_repro.models import build_model

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("config", overrides=overrides)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(cfg.model.name, cfg.data.num_classes, cfg.data.image_size, cfg.model.width,
                        cfg.model.dropout)
    batch = max(1, cfg.global_batch_size // int(os.environ.get("PROFILE_WORLD", "4")))
    images = torch.randn(batch, 3, cfg.data.image_size, cfg.data.image_size)
    labels = torch.randint(0, cfg.data.num_classes, (batch,))
    profile = perfmodel.measure_profile(model, images, labels)
    sparsify = perfmodel.measure_sparsify_s_per_element(profile.elements, cfg.comm.chunk_size or 32768)
    cast = perfmodel.measure_wire_cast_s_per_element(profile.elements)
    out.write_text(json.dumps({"forward_s": profile.forward_s, "backward_s": profile.backward_s,
                               "optimizer_s": profile.optimizer_s, "sparsify_s_per_element": sparsify,
                               "wire_cast_s_per_element": cast,
                               "tensors": [[t.elements, t.ready_s, t.one_dimensional] for t in profile.tensors]}))


def _warmup(run: dict) -> float:
    comm = run["summary"].get("strategy")
    return 1.0 if comm in ("gradientflow", "csc") else 0.0


class _network:
    """The emulated network when available, else nothing (loopback)."""

    def __init__(self, world: int, rate: Optional[float], reason: Optional[str]) -> None:
        self.net = netemu.EmulatedNetwork(world, rate) if reason is None else None

    def __enter__(self) -> Optional[netemu.EmulatedNetwork]:
        return self.net.__enter__() if self.net else None

    def __exit__(self, *exc: object) -> None:
        if self.net:
            self.net.close()


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--netbench":
        _netbench(Path(sys.argv[2]), Path(sys.argv[3]))
    elif len(sys.argv) > 2 and sys.argv[1] == "--profile":
        _profile(Path(sys.argv[2]), sys.argv[4:])
    else:
        main()
