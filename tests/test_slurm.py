"""The Slurm templates under a real Slurm: scripts/local_slurm.sh starts a controller and two
compute daemons (node1, node2) on this machine; jobs are the templates themselves, scaled down
with sbatch options and Hydra overrides (no GPUs, the embedded digits, a few dozen steps).

Needs root and either Slurm or apt-get. Elsewhere the tests are skipped, except where
REQUIRE_SLURM_TESTS=1 (as in CI), where a missing Slurm is a failure."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from gradientflow_repro.distributed import World
from gradientflow_repro.precision import native_bf16

from conftest import REPO, final_params, train

LOCAL_SLURM = REPO / "scripts" / "local_slurm.sh"
SCALED_DOWN = ["--gpus-per-node=0", "--cpus-per-task=1", "--time=15"]


def _why_no_slurm() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm needs root"
    has_slurm = Path("/usr/sbin/slurmctld").exists() and Path("/usr/sbin/slurmd").exists()
    if not has_slurm and subprocess.run(["which", "apt-get"], capture_output=True).returncode != 0:
        return "Slurm is not installed and there is no apt-get to install it"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    reason = _why_no_slurm()
    if reason:
        if os.environ.get("REQUIRE_SLURM_TESTS") == "1":
            pytest.fail(f"REQUIRE_SLURM_TESTS=1 but {reason}")
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "LOCAL_SLURM_DIR": str(state), "SLURM_CONF": str(state / "slurm.conf"),
           "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    started = subprocess.run([str(LOCAL_SLURM), "start", "--nodes", "2"], env=env, capture_output=True,
                             text=True, timeout=300)
    assert started.returncode == 0, f"local Slurm did not start:\n{started.stdout}\n{started.stderr}"
    try:
        yield env
    finally:
        subprocess.run([str(LOCAL_SLURM), "stop"], env=env, timeout=120)
        assert not (state / "slurmctld.pid").exists()


def _overrides(digits_root: Path, run_dir: Path, *extra: str) -> list[str]:
    """The alexnet_512gpu experiment cut to this machine: digits, CPU, bf16 where the CPU has it
    (else fp32: emulated bf16 takes many times as long, and these tests are about Slurm), a narrow model."""
    precision = "bf16" if native_bf16(torch.device("cpu")) else "fp32"
    return ["data=digits", f"data.root={digits_root}", "device=cpu", f"precision={precision}",
            "model.width=0.125", "global_batch_size=128", "optim.warmup_epochs=1",
            "eval_every_epochs=1", "threads_per_rank=1", "dist_timeout_s=60", "logger.log_every=1",
            "save_final_params=true", f"run_dir={run_dir}", *extra]


def _sbatch(env: dict[str, str], options: list[str], overrides: list[str],
            template: str = "slurm/alexnet_512gpu.sh", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--parsable", *options, template, *overrides], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _slurm_diagnostics(env: dict[str, str], job: str) -> str:
    """What Slurm knows about a job that ended unexpectedly: its record and the daemons' log tails."""
    shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                           timeout=30).stdout
    logs = sorted(Path(env["LOCAL_SLURM_DIR"]).glob("slurm*.log"))
    tails = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:])
                      for p in logs)
    return f"--- scontrol show job {job}\n{shown}\n{tails}"


def _ranks(log: str) -> dict[int, tuple[int, str, str]]:
    """rank -> (world size, node name, node id) from the trainer's per-rank start lines."""
    found = re.findall(r"^rank (\d+)/(\d+) local_rank \S+ node (\S+) node_id (\S+) .*world from slurm",
                       log, flags=re.M)
    return {int(rank): (int(world), node, node_id) for rank, world, node, node_id in found}


def test_alexnet_template_runs_one_process_group_under_sbatch_wait(slurm, tmp_path: Path,
                                                                   digits_root: Path) -> None:
    log = tmp_path / "job.out"
    job = _sbatch(slurm, ["--wait", "--nodes=1", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"],
                  _overrides(digits_root, tmp_path / "run", "epochs=1", "max_steps=8"))
    output = log.read_text() if log.exists() else ""
    assert job.returncode == 0, f"{job.stderr}\n{output[-4000:]}"
    assert _ranks(output) == {0: (2, "node1", "0"), 1: (2, "node1", "0")}, output[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 8
    assert summary["command"].startswith("srun --ntasks=2")
    a, b = final_params(tmp_path / "run", 0), final_params(tmp_path / "run", 1)
    for key in a:  # one process group: the ranks' weights agree (BatchNorm buffers are per rank)
        if "running" not in key and "num_batches" not in key:
            assert torch.equal(a[key], b[key]), key


def test_two_nodes_get_the_right_node_ids_and_global_ranks(slurm, tmp_path: Path, digits_root: Path) -> None:
    log = tmp_path / "job.out"
    job = _sbatch(slurm, ["--wait", "--nodes=2", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"],
                  _overrides(digits_root, tmp_path / "run", "epochs=1", "max_steps=4", "comm=hierarchical"))
    output = log.read_text() if log.exists() else ""
    assert job.returncode == 0, f"{job.stderr}\n{output[-4000:]}"
    assert _ranks(output) == {0: (4, "node1", "0"), 1: (4, "node1", "0"),
                              2: (4, "node2", "1"), 3: (4, "node2", "1")}, output[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 4


def test_preempted_job_checkpoints_requeues_and_finishes_like_an_uninterrupted_run(
        slurm, tmp_path: Path, digits_root: Path) -> None:
    common = _overrides(digits_root, tmp_path / "preempted", "epochs=3", "deterministic=true",
                        "checkpoint.every_epochs=100", "data.reader_workers=2")  # workers get the signal too
    log = tmp_path / "job.out"
    submitted = _sbatch(slurm, ["--nodes=1", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"], common)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and '"step": 4,' not in (metrics.read_text() if metrics.exists() else ""):
        time.sleep(0.1)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True, timeout=30)
    # The requeued job is held for cred_expire (10 s in the local Slurm), then restarts by itself.
    state = _ended(slurm, job, deadline - time.monotonic())
    output = log.read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{output[-4000:]}\n{_slurm_diagnostics(slurm, job)}"
    assert "stopped by SIGUSR1" in output and "requeueing" in output, output[-4000:]
    assert re.search(r"job \d+ \(restart 1\)", output), output[-4000:]
    stopped_at = int(re.search(r"stopped by SIGUSR1 after step (\d+)", output).group(1))
    assert f"resumed from {tmp_path / 'preempted'}/checkpoints/step_{stopped_at:09d} at step {stopped_at}" in output
    summary = json.loads((tmp_path / "preempted" / "summary.json").read_text())
    assert summary["steps"] == 33 and summary["stopped_by"] is None
    wandb_runs = sorted((tmp_path / "preempted" / "wandb").glob("offline-run-*"))
    assert len(wandb_runs) == 2 and {p.name.rsplit("-", 1)[1] for p in wandb_runs} == {summary["wandb_run_id"]}

    reference = [a for a in common if not a.startswith("run_dir=")]
    train(2, ["+experiment=alexnet_512gpu", *reference, "logger=jsonl"], tmp_path / "straight")
    for rank in range(2):
        a, b = final_params(tmp_path / "straight", rank), final_params(tmp_path / "preempted", rank)
        for key in a:
            assert torch.equal(a[key], b[key]), f"{key} differs on rank {rank}"


def test_a_rank_killed_under_slurm_fails_the_job_naming_it(slurm, tmp_path: Path, digits_root: Path) -> None:
    log = tmp_path / "job.out"
    env = {**slurm, "GFR_INJECT_FAULT": "kill@forward:rank=1:step=5"}
    job = _sbatch(env, ["--wait", "--nodes=1", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"],
                  _overrides(digits_root, tmp_path / "run", "epochs=1", "max_steps=8"))
    output = log.read_text()
    assert job.returncode != 0, output[-3000:]
    assert "error: rank 1 (node node1) was killed by signal 9 (SIGKILL): ending job step" in output, output[-4000:]
    assert "requeue" not in output  # a crash is not a preemption
    _survivor_says_one_line_at_most(output, survivor=0, lost=1)


def _survivor_says_one_line_at_most(output: str, survivor: int, lost: int) -> None:
    """A survivor is either ended by the step's end before it notices (silent) or names the lost
    rank in one line: no traceback, no Hydra report."""
    assert "Error executing job" not in output and "Traceback" not in output, output[-4000:]
    # nor the task wrapper's shell about its killed children, nor a scancel that the kill it asked
    # for ended taken for a failure
    assert "task.sh: line" not in output and "scancel" not in output, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith(f"error: rank {survivor}:")]
    assert len(lines) <= 1 and all(f"lost rank(s) [{lost}]" in line for line in lines), lines


def test_a_vanished_rank_ends_the_job_within_90_s_with_the_512gpu_timeouts(slurm, tmp_path: Path,
                                                                           digits_root: Path) -> None:
    """Rank 1 is killed (SIGKILL: nothing in it can react) while a child of it keeps its connections
    open (faults.py ``vanish``): rank 0 sees no error, only a collective that never ends, as a dead
    peer looks under NCCL. With the 512-GPU experiment's own watchdog_s and dist_timeout_s (minutes),
    slurm/task.sh ends the step within seconds, naming the rank, and the job fails unrequeued."""
    import signal

    log, fired = tmp_path / "job.out", tmp_path / "fired.jsonl"
    env = {**slurm, "GFR_INJECT_FAULT": "vanish@forward:rank=1:step=5", "GFR_FAULT_LOG": str(fired)}
    overrides = [o for o in _overrides(digits_root, tmp_path / "run", "epochs=1", "max_steps=8")
                 if not o.startswith("dist_timeout_s=")]  # the experiment's: watchdog 300 s, timeout 600 s
    try:
        job = _sbatch(env, ["--wait", "--nodes=1", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"],
                      overrides, timeout=400)
        ended = time.time()
    finally:
        for line in fired.read_text().splitlines() if fired.exists() else []:
            try:  # the holder of the dead rank's sockets, if Slurm left it
                os.kill(json.loads(line)["holder"], signal.SIGKILL)
            except (OSError, TypeError):
                pass
    output = log.read_text()
    assert job.returncode != 0, output[-3000:]
    assert "error: rank 1 (node node1) was killed by signal 9 (SIGKILL): ending job step" in output, output[-4000:]
    assert "the job ends here" in output and "requeue" not in output, output[-3000:]
    _survivor_says_one_line_at_most(output, survivor=0, lost=1)
    seconds = ended - json.loads(fired.read_text().splitlines()[0])["time"]
    assert seconds < 90, f"the job ended {seconds:.0f} s after rank 1 was killed:\n{output[-3000:]}"


def test_asking_for_more_than_the_cluster_has_is_refused_at_once(slurm) -> None:
    started = time.monotonic()
    job = _sbatch(slurm, [], [], timeout=60)  # the template as written: 64 nodes x 8 GPUs
    assert job.returncode != 0 and "sbatch: error:" in job.stderr, job.stderr
    assert time.monotonic() - started < 30
    queued = subprocess.run(["squeue", "-h"], env=slurm, capture_output=True, text=True, timeout=30)
    assert queued.stdout.strip() == "", f"a job was left in the queue: {queued.stdout}"


def test_generic_template_rejects_an_unknown_experiment(slurm, tmp_path: Path) -> None:
    log = tmp_path / "job.out"
    job = _sbatch(slurm, ["--wait", "--nodes=1", "--ntasks-per-node=1", *SCALED_DOWN, f"--output={log}"],
                  ["no_such_experiment"], template="slurm/train.sh")
    assert job.returncode == 2
    assert "first argument must name an experiment" in log.read_text()



# The 512-GPU templates and experiments, read as files: no Slurm needed.
TEMPLATES = ["slurm/alexnet_512gpu.sh", "slurm/resnet50_512gpu.sh"]


@pytest.mark.parametrize("template", TEMPLATES)
def test_templates_enable_nccl_diagnostics_and_show_the_binding_line(template: str) -> None:
    """What a cluster engineer reads in the template: NCCL's flight recorder on and dumped on a
    timeout, the CPU/GPU binding an admin would switch on, the preemption warning to every process of
    the step (no ``B:``: the trainer's handler needs it; the data workers ignore it)."""
    text = (REPO / template).read_text()
    size = re.search(r"^export TORCH_NCCL_TRACE_BUFFER_SIZE=\$\{TORCH_NCCL_TRACE_BUFFER_SIZE:-(\d+)\}$", text, re.M)
    assert size and int(size.group(1)) > 0, f"{template}: no flight recorder"
    assert re.search(r"^export TORCH_NCCL_DUMP_ON_TIMEOUT=\$\{TORCH_NCCL_DUMP_ON_TIMEOUT:-1\}$", text, re.M), template
    assert re.search(r"^##SBATCH --gpu-bind=\S+", text, re.M), f"{template}: no GPU binding line"
    assert re.search(r"^# export SLURM_CPU_BIND=\S+", text, re.M), f"{template}: no CPU binding line"
    assert re.search(r"^#SBATCH --signal=USR1@\d+$", text, re.M), f"{template}: the warning must reach every process"
    assert re.search(r"^#SBATCH --requeue$", text, re.M), template


@pytest.mark.parametrize("experiment", ["alexnet_512gpu", "resnet50_512gpu"])
def test_512gpu_timeouts_name_a_lost_rank_within_a_minute(experiment: str) -> None:
    """With the experiment's own watchdog_s and dist_timeout_s, a rank whose heartbeat stops is named
    within a minute (the beats decide, not watchdog_s, which is minutes: a stuck rank only)."""
    import yaml

    from gradientflow_repro.distributed import Liveness, World

    cfg = yaml.safe_load((REPO / "configs" / "experiment" / f"{experiment}.yaml").read_text())
    watchdog_s, dist_timeout_s = float(cfg["watchdog_s"]), float(cfg["dist_timeout_s"])
    store = torch.distributed.HashStore()
    liveness = Liveness(store, World(0, 512, 0, 8, "127.0.0.1", 0, "slurm"), watchdog_s, nccl=True)
    named_within_s = liveness.lost_after_s + liveness.beat_s  # silent that long, then the next watch
    assert named_within_s <= 60, f"{experiment}: a lost rank is named only after {named_within_s:.0f} s"
    assert watchdog_s <= dist_timeout_s, f"{experiment}: watchdog_s={watchdog_s} > dist_timeout_s={dist_timeout_s}"


@pytest.mark.parametrize("trainer, status, line", [
    ("raise SystemExit(0)", 0, None),
    ("raise SystemExit(75)", 75, None),  # checkpointed after the warning: the batch script requeues
    ("raise SystemExit(3)", 3, "error: rank 5 (node n7) exited with status 3: ending job step ?.?"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + 9,
     "error: rank 5 (node n7) was killed by signal 9 (SIGKILL): ending job step ?.?"),
])
def test_task_wrapper_names_a_crashed_rank_in_one_line_and_lets_0_and_75_pass(
        trainer: str, status: int, line: str | None) -> None:
    """slurm/task.sh alone (no Slurm: no job step to end): which statuses count as a crash, and the
    one line that names the rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "SLURM_STEP_ID")}
    env.update(SLURM_PROCID="5", SLURMD_NODENAME="n7")
    import sys

    result = subprocess.run(["bash", str(REPO / "slurm" / "task.sh"), sys.executable, "-c", trainer], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    assert result.stderr.strip().splitlines() == ([line] if line else []), result.stderr


def test_task_wrapper_takes_a_stop_by_sigterm_for_no_crash() -> None:
    """Slurm's SIGTERM reaches the wrapper and the trainer: the trainer checkpoints and exits 143,
    which is the step ending as asked, not a crash to end the others for."""
    import signal
    import sys

    trainer = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(143)); "
               "print('ready', flush=True); time.sleep(30)")
    env = {k: v for k, v in os.environ.items() if k not in ("SLURM_JOB_ID", "SLURM_STEP_ID")}
    job = subprocess.Popen(["bash", str(REPO / "slurm" / "task.sh"), sys.executable, "-c", trainer],
                           env={**env, "SLURM_PROCID": "5"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        assert job.stdout.readline().strip() == "ready"
        os.killpg(job.pid, signal.SIGTERM)  # as Slurm signals a step: every process
        _, err = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 143 and err.strip() == "", err


# --- slurm/launch.sh: requeue bounds, stop signals, the rendezvous port ----------------------------

def _launch_functions(*names: str) -> str:
    """The named shell functions of slurm/launch.sh, as text to run in bash (the script itself starts
    a job when sourced)."""
    text = (REPO / "slurm" / "launch.sh").read_text()
    found = []
    for name in names:
        function = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", text, re.M | re.S)
        assert function, f"slurm/launch.sh defines no {name}()"
        found.append(function.group(0))
    constants = re.findall(r"^STALLED_MAX=\d+", text, re.M)
    return "\n".join([*constants, *found])


def _bash(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "set -uo pipefail\n" + script, "bash", *args], capture_output=True,
                          text=True, timeout=60)


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@pytest.mark.parametrize("range_line, start", [
    (None, _ephemeral_start()),  # this machine's range, read as a job reads it
    ("32768\t60999", 32768),     # Linux's default
    ("15000 64000", 15000),      # a range starting low: the ports go lower too
    ("49152 65535", 49152),      # IANA's
    ("", 32768),                 # unreadable: Linux's default assumed
])
def test_master_port_is_below_the_ephemeral_range_and_follows_the_job_id(tmp_path: Path, range_line: str | None,
                                                                        start: int) -> None:
    """The rendezvous port of slurm/launch.sh: above 1024 and below where the kernel picks the local
    ports of outgoing connections, for job ids small and large; the same for a requeued job (same
    id), different for jobs submitted one after another (which may share a node)."""
    range_file = tmp_path / "ip_local_port_range"
    if range_line is not None:
        range_file.write_text(range_line + "\n")
    ids = [*range(1, 4001), *range(99_990, 100_010), 2**31 - 1, 4_294_967_294]
    script = _launch_functions("master_port") + '\nfor id in "${@:2}"; do master_port "$id" $1; done'
    where = str(range_file) if range_line is not None else ""
    result = _bash(script, where, *map(str, ids))
    assert result.returncode == 0 and result.stderr == "", result.stderr
    ports = [int(p) for p in result.stdout.split()]
    assert len(ports) == len(ids)
    outside = {i: p for i, p in zip(ids, ports) if not 1024 < p < start}
    assert not outside, f"ports inside the ephemeral range from {start} or below 1025: {list(outside.items())[:5]}"
    assert all(a != b for a, b in zip(ports, ports[1:])), "neighbouring job ids share a port"
    again = _bash(script, where, "3999", "3999")  # a requeued job: the same id
    assert again.stdout.split() == [str(ports[3998])] * 2


def _checkpoint(run_dir: Path, step: int, complete: bool = True, suffix: str = "") -> None:
    path = run_dir / "checkpoints" / f"step_{step:09d}{suffix}"
    path.mkdir(parents=True)
    if complete:
        (path / "manifest.json").write_text("{}")


def test_requeue_bounds_stop_a_job_that_makes_no_progress_or_restarts_too_often(tmp_path: Path) -> None:
    """slurm/launch.sh's decision before each 'scontrol requeue' (no Slurm needed): requeue while a
    newer checkpoint appears; after 2 requeues in a row without one, or once the job has restarted
    MAX_REQUEUES times, refuse with one line naming the step to resume from."""
    run = tmp_path / "run"
    _checkpoint(run, 10)
    _checkpoint(run, 20, complete=False)       # a checkpoint being written: no manifest yet
    _checkpoint(run, 30, suffix=".tmp")        # an interrupted one
    script = _launch_functions("newest_checkpoint_step", "may_requeue") + '\nmay_requeue "$@"'

    def decide(job: str, restarts: int, max_requeues: int = 20) -> subprocess.CompletedProcess:
        return _bash(script, str(run), job, str(restarts), str(max_requeues))

    newest = _bash(_launch_functions("newest_checkpoint_step") + '\nnewest_checkpoint_step "$1"', str(run))
    assert newest.stdout.strip() == "10"
    assert _bash(_launch_functions("newest_checkpoint_step") + '\nnewest_checkpoint_step "$1"',
                 str(tmp_path / "empty")).stdout.strip() == "-1"

    first = decide("7", 0)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    assert "step=10\nstalled=0" in (run / "requeue.state").read_text()
    assert decide("7", 1).returncode == 0               # no newer checkpoint: once is allowed
    stuck = decide("7", 2)
    assert stuck.returncode == 1
    lines = stuck.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: job 7: not requeued: no checkpoint newer than step 10"), lines
    assert f"resubmit with run_dir={run} to resume from step 10" in lines[0]

    _checkpoint(run, 40)                                # progress: the count starts again
    assert decide("7", 3).returncode == 0
    assert "step=40\nstalled=0" in (run / "requeue.state").read_text()
    assert decide("7", 4).returncode == 0
    # a new job resumed in the same directory counts its own requeues without progress
    assert decide("8", 0).returncode == 0

    _checkpoint(run, 50)
    bounded = decide("8", 5, max_requeues=5)
    assert bounded.returncode == 1
    lines = bounded.stderr.strip().splitlines()
    assert len(lines) == 1 and "restarted 5 times (MAX_REQUEUES=5)" in lines[0] and "step 50" in lines[0], lines


def _stand_in_trainer(tmp_path: Path, behaviour: str) -> dict[str, str]:
    """Environment variables under which the templates run ``behaviour`` (Python) in place of the
    trainer: slurm/launch.sh runs ``python -m gradientflow_repro.train ... run_dir=...`` from the
    environment it activates (ENV_VENV), here one whose ``python`` is this script. ``behaviour``
    sees ``run_dir``, ``rank``, ``restart`` (SLURM_RESTART_COUNT) and ``checkpoint(step)``, which
    writes a complete checkpoint directory as the trainer does. For the tests about launch.sh:
    seconds where a real run takes a minute, and a stop-save as long as the test needs."""
    import sys
    import textwrap

    venv = tmp_path / "stand-in-env"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    trainer = venv / "bin" / "python"
    trainer.write_text(f"#!{sys.executable}\n" + textwrap.dedent("""\
        import os, signal, sys, time
        from pathlib import Path
        run_dir = Path(next(a for a in sys.argv if a.startswith("run_dir=")).split("=", 1)[1])
        rank, restart = int(os.environ["SLURM_PROCID"]), int(os.environ.get("SLURM_RESTART_COUNT", "0"))

        def checkpoint(step):
            path = run_dir / "checkpoints" / f"step_{step:09d}"
            path.mkdir(parents=True, exist_ok=True)
            (path / "manifest.json").write_text("{}")
        """) + textwrap.dedent(behaviour))
    trainer.chmod(0o755)
    return {"ENV_VENV": str(venv), "ENV_CONDA": ""}


def _wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {seconds:.0f} s"
        time.sleep(0.1)


def _ended(env: dict[str, str], job: str, seconds: float) -> str:
    """The job's state once it has ended, through its requeues, or the last one seen at the deadline.

    A requeued job is held for cred_expire (10 s in the local Slurm), and then waits for the
    scheduler's next pass over held jobs (backfill's, up to 30 s later). Once its EligibleTime has
    passed, a job update (its comment) makes the scheduler run at once: the job starts when its hold
    ends, as under a scheduler that passes often, not earlier (an earlier start fails it: "Job
    credential revoked")."""
    import datetime

    deadline = time.monotonic() + seconds
    while True:
        shown = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True,
                               timeout=30).stdout
        state = re.search(r"JobState=(\S+)", shown)
        state = state.group(1) if state else "UNKNOWN"
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") or time.monotonic() > deadline:
            return state
        eligible = re.search(r"EligibleTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", shown)
        if state == "PENDING" and eligible and datetime.datetime.now() > (
                datetime.datetime.fromisoformat(eligible.group(1)) + datetime.timedelta(seconds=1)):
            subprocess.run(["scontrol", "update", f"JobId={job}", "Comment=eligible"], env=env,
                           capture_output=True, timeout=30)
        time.sleep(0.5)


def test_sigterm_during_the_stop_save_still_requeues_and_reaches_the_ranks(slurm, tmp_path: Path) -> None:
    """The preemption warning came, the ranks agreed to stop and save, and a SIGTERM reaches the
    batch script while they save (the time limit sends one to it). Here it is sent to that shell
    alone (scancel --batch), so the ranks hear of it only if the script passes it on. The script
    survives it, passes it on (the trainer's handler must see it), waits for the ranks' status (75:
    the agreed requeue stands), requeues, and the job resumes in the same run directory."""
    run, log = tmp_path / "run", tmp_path / "job.out"
    env = {**slurm, **_stand_in_trainer(tmp_path, """\
        if restart:
            print(f"rank {rank}: resumed", flush=True)
            sys.exit(0)
        received = []
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(signum, lambda signum, frame: received.append(signum))
        (run_dir / f"ready{rank}").touch()
        while signal.SIGUSR1 not in received:
            time.sleep(0.05)
        (run_dir / f"saving{rank}").touch()  # the agreed stop: a SIGTERM from now on changes nothing
        deadline = time.monotonic() + 20  # the save lasts until the SIGTERM came (or 20 s)
        while signal.SIGTERM not in received and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        if rank == 0:
            checkpoint(7)
        print(f"rank {rank}: {'SIGTERM' if signal.SIGTERM in received else 'no SIGTERM'} during the save",
              flush=True)
        sys.exit(75)
        """)}
    submitted = _sbatch(env, ["--nodes=1", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"],
                        [f"run_dir={run}"])
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        _wait_for(lambda: (run / "ready0").exists() and (run / "ready1").exists(), "ranks ready")
        subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True, timeout=30)
        _wait_for(lambda: (run / "saving0").exists() and (run / "saving1").exists(), "stop-save")
        subprocess.run(["scancel", "--signal=TERM", "--batch", job], env=slurm, check=True, timeout=30)
        state = _ended(slurm, job, 60)
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=30)
    output = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", f"job {job} ended {state}:\n{output[-4000:]}\n{_slurm_diagnostics(slurm, job)}"
    assert re.search(rf"^job {job}: SIGTERM to the batch script .*passing SIGTERM on to the ranks", output,
                     re.M), output[-3000:]
    assert "rank 0: SIGTERM during the save" in output and "rank 1: SIGTERM during the save" in output, output[-3000:]
    assert re.search(rf"^job {job}: checkpointed after a preemption warning .*requeueing", output, re.M), output
    starts = re.findall(rf"^job {job} \(restart (\d)\) .* run_dir (\S+)$", output, re.M)
    assert starts == [("0", str(run)), ("1", str(run))], output[-3000:]
    assert "rank 0: resumed" in output and not re.search(r"^error", output, re.M), output[-3000:]
    assert "step=7" in (run / "requeue.state").read_text()


def test_a_job_whose_runs_make_no_progress_stops_requeueing(slurm, tmp_path: Path) -> None:
    """Every run asks for a requeue (exit 75) without a checkpoint newer than the first one: after
    two such requeues in a row the job is not requeued again, fails, and says so in one line naming
    the step to resume from."""
    run, log = tmp_path / "run", tmp_path / "job.out"
    env = {**slurm, **_stand_in_trainer(tmp_path, """\
        if restart == 0 and rank == 0:
            checkpoint(5)
        print(f"rank {rank}: asking for a requeue", flush=True)
        sys.exit(75)
        """)}
    submitted = _sbatch(env, ["--nodes=1", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"],
                        [f"run_dir={run}"])
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    try:
        state = _ended(slurm, job, 90)
    finally:
        subprocess.run(["scancel", job], env=slurm, timeout=30)
    output = log.read_text() if log.exists() else ""
    assert state == "FAILED", f"job {job} ended {state}:\n{output[-4000:]}\n{_slurm_diagnostics(slurm, job)}"
    assert re.findall(rf"^job {job} \(restart (\d)\)", output, re.M) == ["0", "1", "2"], output[-3000:]
    assert output.count("requeueing") == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: job {job}: not requeued: no checkpoint newer than step 5 since 2 requeues in a row"
                      f" (the runs stop before they save anything new: see their lines above, e.g. a preemption"
                      f" warning earlier than the start-up takes, or a checkpoint that cannot be written); fix"
                      f" that, then resubmit with run_dir={run} to resume from step 5"], errors


# --- GPU binding: --gpu-bind=closest, each task seeing the GPUs of its NUMA domain ----------------

# What select_device does with CUDA (gradientflow_repro/distributed/world.py), with the fake GPUs named by
# CUDA_VISIBLE_DEVICES (torch sees none of them): prints node, local rank, the task's GPUs and the
# one it picked.
GPU_PROBE = """
import os
from gradientflow_repro.distributed import discover_world, gpu_index, gpu_sharers
world = discover_world()
gpus = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
sharing = gpu_sharers(world, ",".join(gpus)) if 1 < len(gpus) < world.local_world_size else None
picked = gpus[gpu_index(world, len(gpus), os.environ["CUDA_VISIBLE_DEVICES"], sharing)]
print("gpu", os.environ["SLURM_NODEID"], world.local_rank, ",".join(gpus), picked, flush=True)
"""


def _world_on_node(local_rank: int, local_world_size: int) -> World:
    return World(rank=local_rank, world_size=local_world_size, local_rank=local_rank,
                 local_world_size=local_world_size, master_addr="n0", master_port=1, source="slurm")


def _domains(layout: str, tasks: int, domains: int) -> list[int]:
    """The NUMA domain of each local rank: Slurm's default distribution (block:cyclic) alternates
    sockets, block:block fills one first."""
    return [rank % domains if layout == "cyclic" else rank * domains // tasks for rank in range(tasks)]


@pytest.mark.parametrize("layout", ["cyclic", "block"])
@pytest.mark.parametrize("tasks, domains", [(8, 2), (8, 4), (4, 2)])
def test_gpu_index_gives_each_rank_its_own_gpu_among_those_it_shares(layout: str, tasks: int, domains: int) -> None:
    """8 GPUs in NUMA domains, each task seeing its domain's (as CUDA_VISIBLE_DEVICES lists them):
    every rank gets a GPU of its own, whichever way the tasks were spread over the domains."""
    from gradientflow_repro.distributed import gpu_index

    per_domain = 8 // domains
    domain_of = _domains(layout, tasks, domains)
    seen = {d: ",".join(str(d * per_domain + i) for i in range(per_domain)) for d in range(domains)}
    picked = []
    for rank in range(tasks):
        mine = seen[domain_of[rank]]
        sharing = [r for r in range(tasks) if seen[domain_of[r]] == mine]
        picked.append(mine.split(",")[gpu_index(_world_on_node(rank, tasks), per_domain, mine, sharing)])
    assert sorted(picked, key=int) == sorted({*picked}, key=int) and len(picked) == tasks, picked


def test_gpu_index_refuses_more_ranks_than_the_gpus_they_share() -> None:
    from gradientflow_repro.distributed import WorldError, gpu_index

    with pytest.raises(WorldError, match=r"local rank 2 of 6 ranks.*only 2 GPU\(s\).*3 ranks of this node "
                                         r"\(local ranks \[0, 2, 4\]\) see these GPUs"):
        gpu_index(_world_on_node(2, 6), visible=2, cuda_visible_devices="0,1", sharing=[0, 2, 4])


def test_gpu_sharers_exchange_through_a_node_local_folder_and_remove_it(tmp_path: Path) -> None:
    """Eight tasks of one node (threads here) say which GPUs they see; each learns which local ranks
    share its set; the folder is gone afterwards. Outside a Slurm step there is no exchange."""
    import threading

    from gradientflow_repro.distributed import gpu_sharers

    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1", "SLURM_NODEID": "0"}
    sets = ["0,1,2,3" if rank % 2 == 0 else "4,5,6,7" for rank in range(8)]
    answers: dict[int, object] = {}

    def task(rank: int) -> None:
        try:
            answers[rank] = gpu_sharers(_world_on_node(rank, 8), sets[rank], env, timeout_s=30,
                                        folder=tmp_path / "exchange")
        except Exception as error:  # noqa: BLE001 - reported below
            answers[rank] = error

    threads = [threading.Thread(target=task, args=(rank,)) for rank in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert answers == {rank: [0, 2, 4, 6] if rank % 2 == 0 else [1, 3, 5, 7] for rank in range(8)}, answers
    assert not (tmp_path / "exchange").exists()
    assert gpu_sharers(_world_on_node(0, 8), "0,1", {}) is None  # not a Slurm step


def _gpu_step(env: dict[str, str], tmp_path: Path, options: list[str]) -> list[tuple[str, int, str, str]]:
    """Runs GPU_PROBE as a job step with the fake GPUs; (node id, local rank, seen, picked) per task."""
    import sys

    result = subprocess.run(["srun", "--gpus-per-node=8", "--cpus-per-task=1", "--time=5", *options,
                             sys.executable, "-c", GPU_PROBE], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("gpu ")]
    return sorted((node, int(local), seen, picked) for node, local, seen, picked in rows)


def _each_task_has_its_own_gpu(rows: list[tuple[str, int, str, str]], nodes: int, per_node: int) -> None:
    assert len(rows) == nodes * per_node, rows
    for node in {row[0] for row in rows}:
        picked = [row[3] for row in rows if row[0] == node]
        assert len(set(picked)) == per_node, f"node {node}: two ranks on one GPU: {rows}"
    assert all(picked in seen.split(",") for _, _, seen, picked in rows), rows


def test_gpu_bind_by_numa_domain_gives_each_rank_its_own_gpu_under_slurm(slurm, tmp_path: Path) -> None:
    """Under srun with the fake GPUs: closest binding on the local node (one socket: every task sees
    all 8) and, as closest binding on two-socket nodes shows them, each task the GPUs of one
    domain, tasks alternating between the domains (Slurm's default distribution) or filling one
    first, on one node and on two (each node exchanging on its own)."""
    rows = _gpu_step(slurm, tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--gpu-bind=closest"])
    _each_task_has_its_own_gpu(rows, 1, 2)
    assert {seen for *_, seen, _ in rows} == {"0,1,2,3,4,5,6,7"}, rows
    cyclic = _gpu_step(slurm, tmp_path, ["--nodes=1", "--ntasks-per-node=4", "--gpu-bind=mask_gpu:0x3,0xC"])
    _each_task_has_its_own_gpu(cyclic, 1, 4)
    assert [seen for *_, seen, _ in cyclic] == ["0,1", "2,3"] * 2, cyclic  # alternating domains
    block = _gpu_step(slurm, tmp_path, ["--nodes=2", "--ntasks-per-node=3", "--gpu-bind=mask_gpu:0x3,0x3,0xC"])
    _each_task_has_its_own_gpu(block, 2, 3)
    assert [seen for *_, seen, _ in block] == ["0,1", "0,1", "2,3"] * 2, block
    import tempfile

    assert not list(Path(tempfile.gettempdir()).glob("gradientflow-gpus-*")), "the exchange left its folders behind"


# --- slurm/launch.sh: a shard set staged to node-local storage before the ranks start ------------

def _shard_set(tmp_path: Path) -> Path:
    shards = tmp_path / "imagenet-shards"
    (shards / "train").mkdir(parents=True)
    (shards / "manifest.json").write_text("{}")
    return shards


def _stand_in_python(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment (ENV_VENV) whose ``python`` records each call (its arguments, Slurm node and
    rank, whether SIGUSR1 is ignored, when) as a JSON line and exits: with status $STAGE_STATUS
    when it is the stage command, else 0. The record file is returned with the environment."""
    import sys
    import textwrap

    venv, log = tmp_path / "stand-in-env", tmp_path / "calls.jsonl"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'export PATH="{venv / "bin"}:$PATH"\n')
    python = venv / "bin" / "python"
    python.write_text(f"#!{sys.executable}\n" + textwrap.dedent(f"""\
        import json, os, signal, sys, time
        call = {{"argv": sys.argv[1:], "node": os.environ.get("SLURM_NODEID"), "rank": os.environ.get("SLURM_PROCID"),
                "usr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN, "time": time.time()}}
        with open({str(log)!r}, "a") as handle:
            handle.write(json.dumps(call) + "\\n")
        sys.exit(int(os.environ.get("STAGE_STATUS", "0")) if "gradientflow_repro.data.stage" in sys.argv else 0)
        """))
    python.chmod(0o755)
    return {"ENV_VENV": str(venv), "ENV_CONDA": ""}, log


def _calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _stage_data(tmp_path: Path, env: dict[str, str], *overrides: str) -> tuple[subprocess.CompletedProcess, list]:
    """slurm/launch.sh's stage_data alone (no Slurm): ``srun`` is a stub that runs its command once,
    as on a one-node allocation. Returns the result, whose ``stdout`` is TRAIN_OVERRIDES (what the
    function said is appended to ``stderr``), and the stand-in python's calls."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    srun = stubs / "srun"
    srun.write_text('#!/bin/bash\necho "srun $*" >&2\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    venv, log = _stand_in_python(tmp_path) if not (tmp_path / "stand-in-env").exists() else (
        None, tmp_path / "calls.jsonl")
    log.unlink(missing_ok=True)
    script = _launch_functions("stage_data") + '\nstage_data "$@"\nstatus=$?\nprintf "override %s\\n" ' \
        '${TRAIN_OVERRIDES[@]+"${TRAIN_OVERRIDES[@]}"}\nexit $status'
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GF_", "DATA"))}
    path = f"{stubs}:{tmp_path / 'stand-in-env' / 'bin'}:{os.environ['PATH']}"
    result = subprocess.run(["bash", "-c", "set -uo pipefail\n" + script, "bash", *overrides], capture_output=True,
                            text=True, timeout=60, env={**base, "PATH": path, "SLURM_JOB_ID": "9",
                                                        "SLURM_JOB_NUM_NODES": "1", **env})
    lines = result.stdout.splitlines()
    said = [line for line in lines if not line.startswith("override ")]
    overrides = [line.removeprefix("override ") for line in lines if line not in said]
    return subprocess.CompletedProcess(result.args, result.returncode, overrides, result.stderr + "".join(
        line + "\n" for line in said)), _calls(log)


def test_stage_data_copies_a_shard_set_once_per_node_and_points_the_ranks_at_the_copy(tmp_path: Path) -> None:
    shards, local = _shard_set(tmp_path), tmp_path / "local"
    folders = tmp_path / "imagenet"
    (folders / "train").mkdir(parents=True)
    # a shard set (DATA): staged by one task per node, then read there by data=imagenet_shards
    result, calls = _stage_data(tmp_path, {"DATA": str(shards), "GF_LOCAL_DATA": str(local),
                                           "GF_STAGE_ARGS": "--workers 3"}, "epochs=1")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ["data=imagenet_shards", "epochs=1", f"data.root={local}/imagenet-shards"]
    assert re.search(r"^srun --nodes=1 --ntasks=1 --ntasks-per-node=1 .*--kill-on-bad-exit=1 ", result.stderr,
                     re.M), result.stderr
    assert [c["argv"] for c in calls] == [["-m", "gradientflow_repro.data.stage", "--manifest",
                                          f"{shards}/manifest.json", "--to", f"{local}/imagenet-shards",
                                          "--workers", "3"]]
    assert calls[0]["usr1_ignored"], "the preemption warning would kill the copy"
    # named by an override, with its data config: that one is kept, the copy replaces the root
    result, calls = _stage_data(tmp_path, {"DATA": str(folders), "GF_LOCAL_DATA": str(local)},
                                f"data.root={shards}", "data=imagenet_shards")
    assert result.returncode == 0 and len(calls) == 1, result.stderr
    assert result.stdout == ["data=imagenet_shards", f"data.root={local}/imagenet-shards"]
    # GF_STAGE=0: read where it is
    result, calls = _stage_data(tmp_path, {"DATA": str(shards), "GF_STAGE": "0"}, "epochs=1")
    assert result.returncode == 0 and calls == [], result.stderr
    assert result.stdout == ["data=imagenet_shards", "epochs=1", f"data.root={shards}"]
    # class folders: nothing staged, nothing added
    result, calls = _stage_data(tmp_path, {"DATA": str(folders)}, "epochs=1")
    assert result.returncode == 0 and calls == [] and result.stdout == ["epochs=1"], result.stderr
    # GF_STAGE=1 insists; a failed copy and a bad setting end the job before any rank starts
    result, calls = _stage_data(tmp_path, {"DATA": str(folders), "GF_STAGE": "1"})
    assert result.returncode == 2 and "is no shard set" in result.stderr and calls == [], result.stderr
    result, calls = _stage_data(tmp_path, {"DATA": str(shards), "GF_LOCAL_DATA": str(local), "STAGE_STATUS": "1"})
    assert result.returncode == 1 and len(calls) == 1, result.stderr
    assert re.search(r"^error: job 9: staging .* failed \(above\); the ranks were not started", result.stderr, re.M)
    result, _ = _stage_data(tmp_path, {"DATA": str(shards), "GF_STAGE": "yes"})
    assert result.returncode == 2 and "GF_STAGE=yes" in result.stderr, result.stderr


def test_template_stages_a_shard_set_on_every_node_before_the_ranks_start(slurm, tmp_path: Path) -> None:
    """Two nodes of two tasks: the stage command runs once on each node, with the preemption warning
    ignored, before any rank; every rank reads the node-local copy. A copy that fails ends the job
    before any rank starts, with one line saying so."""
    shards, local, log = _shard_set(tmp_path), tmp_path / "local", tmp_path / "job.out"
    venv, calls_file = _stand_in_python(tmp_path)
    env = {**slurm, **venv, "DATA": str(shards), "GF_LOCAL_DATA": str(local)}
    job = _sbatch(env, ["--wait", "--nodes=2", "--ntasks-per-node=2", *SCALED_DOWN, f"--output={log}"],
                  [f"run_dir={tmp_path / 'run'}"])
    output = log.read_text() if log.exists() else ""
    assert job.returncode == 0, f"{job.stderr}\n{output[-3000:]}"
    calls = _calls(calls_file)
    staged = [c for c in calls if "gradientflow_repro.data.stage" in c["argv"]]
    ranks = [c for c in calls if "gradientflow_repro.train" in c["argv"]]
    assert sorted(c["node"] for c in staged) == ["0", "1"], staged
    assert all(c["usr1_ignored"] and c["argv"][-2:] == ["--to", f"{local}/imagenet-shards"] for c in staged), staged
    assert sorted(c["rank"] for c in ranks) == ["0", "1", "2", "3"], ranks
    assert all("data=imagenet_shards" in c["argv"] and f"data.root={local}/imagenet-shards" in c["argv"]
               for c in ranks), ranks
    assert max(c["time"] for c in staged) < min(c["time"] for c in ranks)
    assert re.search(r"^job \d+: staged on every node in \d+ s$", output, re.M), output[-3000:]

    calls_file.unlink()
    failing = _sbatch({**env, "STAGE_STATUS": "1"}, ["--wait", "--nodes=2", "--ntasks-per-node=2", *SCALED_DOWN,
                                                     f"--output={log}"], [f"run_dir={tmp_path / 'run2'}"])
    output = log.read_text()
    assert failing.returncode != 0, output[-3000:]
    assert not [c for c in _calls(calls_file) if "gradientflow_repro.train" in c["argv"]], "ranks started"
    assert len(re.findall(r"^error: job \d+: staging .* failed \(above\); the ranks were not started", output,
                          re.M)) == 1, output[-3000:]
