"""The comparison of `make reproduce`: the scaling model on hand-computed cases, the network
emulation's set-up and complete tear-down, and a short comparison end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gradientflow_repro.cluster import netemu
from gradientflow_repro.cluster.launch import run_ranks
from gradientflow_repro.comm import knobs
from gradientflow_repro.comm.plan import resolve
from gradientflow_repro.reproduction import lineup
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling.profile import measure_wire_cast_s_per_element

from conftest import REPO
from support import needs_netemu

# ---------------------------------------------------------------- the scaling model by hand
PROFILE = pm.ModelProfile(forward_s=0.010, backward_s=0.020, optimizer_s=0.005, tensors=(
    pm.TensorProfile(1_000_000, 0.005), pm.TensorProfile(1000, 0.010, True),
    pm.TensorProfile(3_000_000, 0.020)))


def test_one_gpu_is_compute_only() -> None:
    net = pm.Network(1e9, 1e-5)
    for strategy in pm.LADDER:
        step = pm.predict_step(PROFILE, 1, net, strategy)
        assert step.step_s == pytest.approx(0.035) and step.comm_s == 0
        assert pm.speedup(PROFILE, 1, net, strategy) == pytest.approx(1.0)


def test_bandwidth_bound_ring_after_backward() -> None:
    net = pm.Network(bandwidth_Bps=1e8, latency_s=0.0)
    step = pm.predict_step(PROFILE, 4, net, pm.Strategy("ring"))
    # 2(N-1)/N of each large tensor's fp32 bytes at 1e8 B/s, all after backward: 4,000,000 x 4 x 1.5 / 1e8;
    # the 1000-element tensor is small: recursive doubling, log2(4) = 2 exchanges of its 4000 bytes
    assert step.comm_s == pytest.approx(4_000_000 * 4 * 1.5 / 1e8 + 2 * 4000 / 1e8)
    assert step.step_s == pytest.approx(0.035 + 0.24008)
    assert step.bytes_per_rank == pytest.approx(4_000_000 * 4 * 1.5 + 2 * 4000)
    # latency: 2(N-1) messages per ring allreduce (two of them), log2(N) for the small one
    slow = pm.predict_step(PROFILE, 4, pm.Network(1e8, 1e-3), pm.Strategy("ring"))
    assert slow.comm_s - step.comm_s == pytest.approx(2 * 6 * 1e-3 + 2 * 1e-3)


def test_builtin_allreduce_priced_from_its_own_measurement() -> None:
    # without its own figures the backend's allreduce is a ring (NCCL on a cluster)
    ring_net = pm.Network(1e8, 1e-3)
    builtin = pm.Strategy("allreduce", algorithm="builtin")
    ring_only = pm.Strategy("ring", small_message_bytes=0)  # (our ring strategy sends small tensors otherwise)
    assert pm.predict_step(PROFILE, 4, ring_net, builtin).comm_s == pm.predict_step(PROFILE, 4, ring_net,
                                                                                    ring_only).comm_s
    # with its cost by message size (gloo picks its own algorithm): each tensor from the table
    measured = pm.Network(1e8, 1e-3, builtin_cost_by_size=((4000, 2e-3), (4_000_000, 20e-3)))
    step = pm.predict_step(PROFILE, 4, measured, builtin)
    assert step.comm_s == pytest.approx(20e-3 + 2e-3 + 60e-3)  # 4 MB, 4 kB on the table, 12 MB beyond it
    assert pm.predict_step(PROFILE, 4, measured, pm.Strategy("ring")).comm_s == pm.predict_step(
        PROFILE, 4, ring_net, pm.Strategy("ring")).comm_s  # our ring keeps its own description


def test_measured_cost_interpolates_between_sizes() -> None:
    table = ((5000, 3e-3), (1000, 1e-3))  # any order
    assert pm.measured_cost_s(500, table) == pytest.approx(1e-3)  # below the smallest: its cost
    assert pm.measured_cost_s(3000, table) == pytest.approx(2e-3)  # halfway: halfway
    assert pm.measured_cost_s(10_000, table) == pytest.approx(6e-3)  # beyond the largest: by bytes


def test_full_overlap_hides_communication() -> None:
    fast = pm.Network(bandwidth_Bps=1e12, latency_s=0.0)
    lazy = pm.Strategy("lazy", fusion="bucket", bucket_bytes=1, overlap=True)  # one bucket per tensor
    step = pm.predict_step(PROFILE, 8, fast, lazy)
    # the last bucket is ready at the end of backward and costs 3e6*4*1.75/1e12 = 21 us
    assert step.exposed_comm_s == pytest.approx(3e6 * 4 * 1.75 / 1e12)
    early = pm.ModelProfile(0.010, 0.020, 0.0, (pm.TensorProfile(1000, 0.001),))
    assert pm.predict_step(early, 8, pm.Network(1e9, 0.0), lazy).exposed_comm_s == 0
    assert pm.predict_step(early, 8, pm.Network(1e9, 0.0), lazy).step_s == pytest.approx(0.030)


def test_fp16_wire_and_csc_shrink_the_bytes() -> None:
    net = pm.Network(1e8, 0.0)
    dense = pm.predict_step(PROFILE, 2, net, pm.Strategy("ring"))
    half = pm.predict_step(PROFILE, 2, net, pm.Strategy("ring+fp16", wire_bytes=2))
    # + the agreed scale (one fp32 value) of each message the ring carries; the small 1-D tensor
    # goes by recursive doubling with its scale's exponent inside (one fp16 value), agreeing on none
    assert half.bytes_per_rank == pytest.approx(dense.bytes_per_rank / 2 + 2 * 4 + 2, abs=1e-6)
    latent = pm.Network(1e8, 1e-3)
    (first, small, last) = pm.messages(PROFILE, pm.Strategy("ring+fp16", wire_bytes=2))
    assert [pm.self_scaled(m, latent, pm.Strategy("ring+fp16", wire_bytes=2)) for m in (first, small, last)] == \
        [False, True, False]
    # the two agreements cost log2(2) = 1 latency each; the self-scaled message none (gloo), but on
    # NCCL, whose allreduce carries small messages, it agrees too
    agree = 1e-3 + 4 / 1e8
    rings = 2 * (1e-3 + 2e6 / 2e8) + 2 * (1e-3 + 6e6 / 2e8)  # 2(N-1) messages of S/N
    half_fp16 = pm.Strategy("ring+fp16", wire_bytes=2)
    assert pm.predict_step(PROFILE, 2, latent, half_fp16).comm_s == pytest.approx(
        rings + 2 * agree + (1e-3 + 2000 / 1e8))
    # at world size 4, a message of exactly the threshold still goes by recursive doubling (two
    # steps), with its exponent: as SizedSum decides, by the fp16 payload
    at_threshold = pm.Strategy("ring+fp16", wire_bytes=2, small_message_bytes=2000)
    assert pm.predict_step(PROFILE, 4, latent, at_threshold).bytes_per_rank == pytest.approx(
        1.5 * (2e6 + 6e6) + 2 * (2 * 4) + 2 * 2002, abs=1e-6)
    nccl = replace(latent, nccl=True)
    assert not pm.self_scaled(small, nccl, half_fp16)
    assert pm.predict_step(PROFILE, 2, nccl, half_fp16).comm_s == pytest.approx(rings + 3 * agree + (1e-3 + 2000 / 1e8))
    csc = pm.predict_step(PROFILE, 2, net, pm.Strategy("csc", density=0.1, chunk_elements=1000))
    expected = (4_000_000 * 0.1 * 4 + 4_000_000 / 1000 * 4 + 1000 * 4)  # sent + norms + 1-D dense
    assert csc.bytes_per_rank == pytest.approx(expected)
    # CSC's local work (per element of the multi-dimensional tensors) lies on the communication path
    working = pm.ModelProfile(PROFILE.forward_s, PROFILE.backward_s, PROFILE.optimizer_s, PROFILE.tensors,
                              sparsify_s_per_element=1e-9)
    slower = pm.predict_step(working, 2, net, pm.Strategy("csc", density=0.1, chunk_elements=1000))
    assert slower.step_s - csc.step_s == pytest.approx(4_000_000 * 1e-9)
    # the fp16 wire's cast work is paid per element sent: all of them dense, the chosen ones with CSC
    casting = pm.ModelProfile(PROFILE.forward_s, PROFILE.backward_s, PROFILE.optimizer_s, PROFILE.tensors,
                              wire_cast_s_per_element=1e-9)
    # (the 1-D tensor goes self-scaled: its one recursive-doubling step at world size 2 does the
    # wire's work once more)
    assert (pm.predict_step(casting, 2, net, pm.Strategy("ring+fp16", wire_bytes=2)).step_s - half.step_s
            == pytest.approx(4_001_000 * 1e-9 + 1000 * 1e-9))
    sparse_half = pm.Strategy("csc+fp16", density=0.1, chunk_elements=1000, wire_bytes=2)
    assert (pm.predict_step(casting, 2, net, sparse_half).step_s - pm.predict_step(PROFILE, 2, net, sparse_half).step_s
            == pytest.approx((4_000_000 * 0.1 + 1000 + 1000) * 1e-9))  # (the 1-D one self-scaled, as above)
    assert pm.predict_step(casting, 2, net, pm.Strategy("ring")).step_s == dense.step_s
    assert 0 < measure_wire_cast_s_per_element(100_000, repeats=2) < 1e-6  # measured, not assumed


def test_csc_under_momentum_correction_pays_the_optimizers_plain_step() -> None:
    """Sparse under momentum correction, the optimizer runs as plain SGD (CSC's local work does its
    momentum, weight decay and Lars's adaptation): the model prices that step, measured by the
    profile on the run's own optimizer, and the whole step otherwise."""
    from gradientflow_repro.optim import Lars
    from gradientflow_repro.scaling.profile import measure_optimizer_s

    plain = replace(PROFILE, plain_optimizer_s=0.001)
    net = pm.Network(1e9, 1e-5)
    gradientflow = pm.Strategy.from_plan("gradientflow", resolve({"strategy": "gradientflow-paper"}))
    assert gradientflow.takes_optimizer and gradientflow.density < 1
    whole_step, plain_step = (pm.predict_step(profile, 4, net, gradientflow).step_s for profile in (PROFILE, plain))
    assert whole_step - plain_step == pytest.approx(0.004)
    assert plain.scaled(2.0).plain_optimizer_s == pytest.approx(0.002)
    for strategy in (pm.Strategy.from_plan("no-mc", resolve({"strategy": "gradientflow",
                                                                     "momentum_correction": False})),
                     replace(gradientflow, density=1.0), *(s for s in pm.LADDER if not s.takes_optimizer)):
        assert pm.predict_step(plain, 4, net, strategy) == pm.predict_step(PROFILE, 4, net, strategy), strategy.name
    assert pm.predict_step(plain, 1, net, gradientflow).step_s == pytest.approx(0.035)  # one GPU: no CSC
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(512, 512)) for _ in range(4)]
    for weight in weights:
        weight.grad = torch.randn_like(weight)
    lars = Lars([{"params": weights, "weight_decay": 1e-4}], lr=0.1, momentum=0.9)
    own = dict(lars.param_groups[0])
    whole, sgd = measure_optimizer_s(lars, repeats=5)
    assert 0 < sgd < whole  # Lars's norms, trust ratios and momentum, measured (about 4x here)
    assert lars.param_groups[0] == own  # its settings back


def test_csc_pool_parts_and_norms_as_the_communicator_sends_them() -> None:
    # one pool part: the norms in one small allreduce (recursive doubling), the chosen chunks and
    # the 1-D tensor in one payload by our ring (latency 1 ms, 1e8 B/s)
    net = pm.Network(1e8, 1e-3, builtin_cost_by_size=((16_000, 2e-3), (32_000, 3e-3)))
    csc = pm.Strategy("csc", fusion="bucket", bucket_bytes=1e9, density=0.1, chunk_elements=1000)
    (only,) = pm.messages(PROFILE, csc)
    # 4000 chunks of the multi-dimensional gradients, 400 sent, then the 1-D one; 4000 norms
    assert (only.payload_bytes, only.small_bytes, only.ready_s) == ((400_000 + 1000) * 4, 4000 * 4, 0.020)
    step = pm.predict_step(PROFILE, 4, net, csc)
    norms = 2 * (1e-3 + 16_000 / 1e8)  # log2(4) exchanges of the whole vector: the table is the builtin's
    payload = 6 * (1e-3 + 401_000 * 4 / (4 * 1e8))
    assert step.comm_s == pytest.approx(norms + payload)
    # with the fp16 wire the peak rides with the norms: one more value, no separate allreduce
    (half,) = pm.messages(PROFILE, pm.Strategy("gf", fusion="bucket", bucket_bytes=1e9, density=0.1,
                                               chunk_elements=1000, wire_bytes=2))
    assert (half.payload_bytes, half.small_bytes) == ((400_000 + 1000) * 2, 4001 * 4)
    # under LARS each multi-dimensional tensor's trust-ratio noise sketch rides too: its squared
    # norm and 64 buckets (csc.TrustNoise); the benchmark's SGD sends none
    (sketched,) = pm.messages(PROFILE, replace(csc, noise_sketch=True))
    assert sketched.small_bytes == (4000 + 2 * 65) * 4
    full_stack = resolve({"strategy": "gradientflow-paper"})  # (the sketches: under momentum correction)
    noise_corrected = replace(full_stack, keys=replace(full_stack.keys, trust_noise_correction=True))
    assert pm.Strategy.from_plan("gf", noise_corrected).noise_sketch
    assert not pm.Strategy.from_plan("gf", resolve({"strategy": "gradientflow"})).noise_sketch
    assert not pm.Strategy.from_plan("gf", noise_corrected, lars=False).noise_sketch
    assert not pm.Strategy.from_plan("gf", full_stack).noise_sketch  # the paper's: no noise correction
    # the report's model check asks the runs: Lars without weight decay adapts nothing, sends none
    from gradientflow_repro.reproduction.runs import sends_trust_sketches
    assert sends_trust_sketches({"config": {"optim": {"name": "lars", "weight_decay": 5e-4}}})
    assert not sends_trust_sketches({"config": {"optim": {"name": "lars", "weight_decay": 0.0}}})
    assert not sends_trust_sketches({"config": {"optim": {"name": "apex_larc", "weight_decay": 5e-4}}})
    assert sends_trust_sketches({"summary": {}})  # configuration unknown: the default recipe's
    # parts are cut by the pool's rule: a small threshold gives one part per tensor in backward order
    parts = pm.messages(PROFILE, pm.Strategy("csc", fusion="bucket", bucket_bytes=1, density=0.1,
                                             chunk_elements=1000))
    assert [(m.payload_bytes, m.small_bytes) for m in parts] == [(100_000 * 4, 1000 * 4), (1000 * 4, 0),
                                                                 (300_000 * 4, 3000 * 4)]
    # a part is padded to whole chunks, and the sent count rounds up as select_chunks does
    odd = pm.ModelProfile(0.01, 0.02, 0.0, (pm.TensorProfile(10_500, 0.02),))
    (alone,) = pm.messages(odd, pm.Strategy("csc", fusion="bucket", density=0.1, chunk_elements=1000))
    assert (alone.payload_bytes, alone.small_bytes) == (2 * 1000 * 4, 11 * 4)


def test_small_messages_take_log2_steps_and_share_the_node_uplink() -> None:
    assert [len(steps) for steps in map(pm.recursive_doubling_pairs, (2, 3, 4, 5, 8, 512))] == [1, 3, 2, 4, 3, 9]
    flat = pm.Network(1e8, 1e-3)
    assert pm.allreduce_s(400, 8, flat) == pytest.approx(3 * (1e-3 + 400 / 1e8))  # small: 3 steps, not 14
    assert pm.allreduce_s(4e6, 8, flat) == pytest.approx(14 * (1e-3 + 4e6 / 8 / 1e8))  # large: the ring
    # 2 nodes x 4: distances 1 and 2 stay inside a node; at distance 4 all 4 ranks cross one uplink
    nodes = pm.Network(1e8, 1e-3, ranks_per_node=4, intra_bandwidth_Bps=1e10, intra_latency_s=1e-5)
    assert pm.small_allreduce_s(400, 8, nodes) == pytest.approx(2 * (1e-5 + 400 / 1e10) + 1e-3 + 4 * 400 / 1e8)
    # a partly filled last node (world 6 = 4 + 2): still priced, no crash
    assert pm.small_allreduce_s(400, 6, nodes) > pm.small_allreduce_s(400, 4, nodes)
    assert pm.allreduce_s(4e6, 12, nodes, "hierarchical") == pytest.approx(
        2 * 4e6 / 1e10 + 2 * 3 * 1e-5 + 2 * 2 * (1e-3 + 4e6 / (3 * 1e8)))


def test_auto_is_two_level_only_on_several_nodes_of_several_ranks() -> None:
    from gradientflow_repro.comm.knobs import two_level

    assert [two_level("auto", world, per_node) for world, per_node in ((8, 4), (8, 8), (8, 1), (8, None))] == [
        True, False, False, False]
    assert two_level("hierarchical", 8, 8) and not two_level("ring", 8, 4) and not two_level("builtin", 8, 4)
    nodes = pm.Network(1e8, 1e-3, ranks_per_node=4, intra_bandwidth_Bps=1e10)
    assert pm.allreduce_s(4e6, 16, nodes, "auto") == pm.allreduce_s(4e6, 16, nodes, "hierarchical")
    assert pm.allreduce_s(4e6, 4, nodes, "auto") == pm.allreduce_s(4e6, 4, nodes, "ring")


def test_hierarchical_ring_runs_among_node_leaders() -> None:
    net = pm.Network(1e8, 1e-3, ranks_per_node=4, intra_bandwidth_Bps=1e9, intra_latency_s=0.0)
    cost = pm.allreduce_s(4e6, 16, net, "hierarchical")
    assert cost == pytest.approx(2 * 4e6 / 1e9 + 2 * 3 * (1e-3 + 4e6 / (4 * 1e8)))


def test_an_emulated_links_burst_credit_is_spent_and_refilled() -> None:
    # one 4 MB tensor after backward, a ring of 2 ranks: 2 (1 ms + 2 MB / 1e8 B/s) = 42 ms
    one = pm.ModelProfile(0.010, 0.020, 0.005, (pm.TensorProfile(1_000_000, 0.020),))
    ring = pm.Strategy("ring")
    assert pm.predict_step(one, 2, pm.Network(1e8, 1e-3), ring).comm_s == pytest.approx(0.042)
    # a 100 kB bucket refills in the 35 ms of compute between messages: 1 ms off every step
    assert pm.predict_step(one, 2, pm.Network(1e8, 1e-3, burst_bytes=1e5), ring).comm_s == pytest.approx(0.041)
    # a bucket deeper than the 4 MB the ring puts on the link: the steady state spends what 35 ms
    # of idle link refill (3.5 MB), not the full bucket the first step had
    assert pm.predict_step(one, 2, pm.Network(1e8, 1e-3, burst_bytes=1e7), ring).comm_s == pytest.approx(0.007)
    # two messages back to back: the second finds the bucket empty
    two = pm.ModelProfile(0.010, 0.020, 0.005, (pm.TensorProfile(1_000_000, 0.020),) * 2)
    assert pm.predict_step(two, 2, pm.Network(1e8, 1e-3, burst_bytes=1e5), ring).comm_s == pytest.approx(0.083)
    # local work keeps the link idle: CSC's (1 ns per element, 1 ms per part) refills 100 kB
    # before each part; each of the two parts sends 100 chunks of 1000 elements (400 kB) by the ring
    csc = pm.Strategy("csc", fusion="bucket", bucket_bytes=4e6, density=0.1, chunk_elements=1000,
                      small_message_bytes=4096)
    working = replace(two, sparsify_s_per_element=1e-9)
    plain = pm.predict_step(working, 2, pm.Network(1e8, 1e-3), csc).comm_s
    assert pm.predict_step(working, 2, pm.Network(1e8, 1e-3, burst_bytes=1e5), csc).comm_s == pytest.approx(
        plain - 2 * 1e5 / 1e8)
    # what crosses a link: 2(n-1)/n of the payload over all ranks, or over the node leaders
    nodes = pm.Network(1e8, 1e-3, ranks_per_node=4, intra_bandwidth_Bps=1e10)
    assert pm.uplink_bytes(4e6, 16, nodes, pm.Strategy("h", algorithm="hierarchical")) == pytest.approx(6e6)
    assert pm.uplink_bytes(4e6, 16, nodes, ring) == pytest.approx(7.5e6)
    assert pm.uplink_bytes(4e6, 4, nodes, ring) == 0  # one node: its ring stays off the uplink
    # recursive doubling (2 nodes x 4): at distance 4 the node's 4 ranks cross its uplink at once
    assert pm.uplink_bytes(4e3, 8, nodes, ring) == pytest.approx(4 * 4e3)
    assert pm.uplink_bytes(4e3, 4, pm.Network(1e8, 1e-3), ring) == pytest.approx(2 * 4e3)  # 1 per node


def test_paper_arithmetic_is_stated() -> None:
    ratio, text = pm.paper_dense_ratio()
    assert 1.5 < ratio < 2.1 and "410.2" in text and "56 Gbit/s" in text
    assert pm.PAPER_SINGLE_GPU_IMAGES_S == pytest.approx(1_281_167 * 95 / 90 / 410.2)


# ---------------------------------------------------------------- network emulation
def test_emulated_network_leaves_nothing_behind_when_a_rank_fails(tmp_path: Path) -> None:
    needs_netemu()
    before = set(netemu.namespaces())
    with netemu.EmulatedNetwork(2, rate_mbit=100) as net:
        names = set(netemu.namespaces(net.prefix))
        assert names == {f"{net.prefix}sw", f"{net.prefix}n0", f"{net.prefix}n1"}
        shaped = subprocess.run(["ip", "netns", "exec", net.namespace(1), "tc", "qdisc", "show", "dev", "eth0"],
                                capture_output=True, text=True).stdout
        assert "tbf" in shaped and "100Mbit" in shaped
        # rank 1 fails at once; rank 0 would wait forever for it
        script = ("import os, sys, time\n"
                  "if os.environ['RANK'] == '1': sys.exit(3)\n"
                  "print('[waiting]', flush=True); time.sleep(600)\n")
        with pytest.raises(RuntimeError, match="exit codes"):
            run_ranks(2, [script], tmp_path, "failing", net, timeout_s=20, module=("-c",))
        pids = [p.pid for p in net.processes]
    assert set(netemu.namespaces()) == before, "namespaces left behind"
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_signal_unwinds_once_and_a_second_does_not_cut_the_clean_up_short(monkeypatch) -> None:
    monkeypatch.setattr(netemu, "_unwinding", False)  # this process stays: what the handler marks is undone after
    saved = {signum: signal.getsignal(signum) for signum in netemu.STOP_SIGNALS}
    try:
        for signum, raised in [(signal.SIGTERM, SystemExit), (signal.SIGHUP, SystemExit),
                               (signal.SIGINT, KeyboardInterrupt)]:
            netemu.end_on_signals()
            with pytest.raises(raised) as stop:
                os.kill(os.getpid(), signum)
                time.sleep(5)  # the handler runs before this ends
            assert raised is KeyboardInterrupt or stop.value.code == 128 + signum
            assert all(signal.getsignal(s) == signal.SIG_IGN for s in saved)  # unwinding: later ones ignored
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)  # still here
        if netemu.why_unavailable() is None:  # the network's tear-down does not re-arm them midway
            monkeypatch.setattr(netemu, "_unwinding", False)
            netemu.end_on_signals()
            with pytest.raises(SystemExit):
                with netemu.EmulatedNetwork(2, None) as net:
                    prefix = net.prefix
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and not netemu.namespaces(prefix)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def test_ctrl_c_ends_a_script_with_130_and_no_traceback(tmp_path: Path) -> None:
    """``run_script``: Ctrl-C unwinds the script (``finally`` runs, as the ranks' and the network's
    clean-up does) and it exits as a shell reports SIGINT, without a traceback after its own last line."""
    script = tmp_path / "long.py"
    script.write_text(
        "import os, signal, time\n"
        "from gradientflow_repro.cluster.netemu import run_script\n"
        "def main():\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        time.sleep(30)\n"
        "    finally:\n"
        "        print('cleaned up', flush=True)\n"
        "run_script(main)\n")
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 128 + signal.SIGINT, done.stderr
    assert done.stdout == "cleaned up\n" and "Traceback" not in done.stderr, done.stderr


# ---------------------------------------------------------------- the comparison, short
def _running_with(text: str) -> list[str]:
    """Command lines of this machine's processes that contain ``text``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in line:
            found.append(line)
    return found


@pytest.mark.timeout(1500)  # three launches, each with its own deadline within this
def test_short_comparison_interrupted_continues_and_writes_a_complete_report(tmp_path: Path,
                                                                             digits_root: Path) -> None:
    report = tmp_path / "REPORT.md"
    command = [sys.executable, "scripts/reproduce.py", "--world", "2", "--check-world", "--repeats", "1",
               "--rungs", "allreduce", "ring+fp16+lazy", "--netbench-launches", "2",
               "--runs-dir", str(tmp_path / "runs"),
               "--out", str(report), "--timeout-s", "240", "--",
               f"data.root={digits_root}", "model.width=0.125", "epochs=2", "eval_every_epochs=1",
               "optim.warmup_epochs=0.5", "target_top1=20"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    # launch 1: stopped by a SIGTERM while its last job (the second training run) trains
    first = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    printed = []
    cut_short = tmp_path / "runs" / "ring+fp16+lazy" / "seed0"
    for line in first.stdout:
        printed.append(line)
        if line.startswith("reproduce: [4/4]"):
            deadline = time.monotonic() + 60  # both ranks started, then the signal
            while len(_running_with(f"run_dir={cut_short}")) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(_running_with(f"run_dir={cut_short}")) >= 2, "the last job's ranks never started"
            first.send_signal(signal.SIGTERM)
            break
    printed.append(first.communicate(timeout=120)[0])
    printed = "".join(printed)
    assert first.returncode == 128 + signal.SIGTERM, printed[-3000:]
    # progress: which job of how many, the time left; rank 0's lines of each run
    jobs = re.findall(r"reproduce: \[(\d+)/(\d+)\] (.*?) \| \S+ so far, about \S+ left", printed)
    assert [(int(i), int(n)) for i, n, _ in jobs] == [(i, 4) for i in range(1, 5)], jobs
    assert [title for _, _, title in jobs][2:] == ["[allreduce] seed 0 (1 of 1)", "[ring+fp16+lazy] seed 0 (1 of 1)"]
    assert "allreduce s0 |" in printed and "reproduce: stopped; 3 finished jobs are kept" in printed
    if netemu.why_unavailable() is None:
        assert not netemu.namespaces(f"{netemu.PREFIX}{first.pid}-"), "namespaces left behind after the SIGTERM"
    assert not _running_with(f"run_dir={cut_short}"), "ranks left running after the SIGTERM"
    assert not (tmp_path / "runs" / "reproduce.json").exists() and not report.exists()
    kept = tmp_path / "runs" / "allreduce" / "seed0" / "summary.json"
    kept_bytes = kept.read_bytes()

    # another plan is refused before anything is touched
    other = [("2" if arg == "1" and command[i - 1] == "--repeats" else arg) for i, arg in enumerate(command)]
    refused = subprocess.run(other, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "another repeats (1, now 2)" in refused.stderr, refused.stderr[-2000:]
    assert "--fresh" in refused.stderr and kept.read_bytes() == kept_bytes

    # launch 2, the same command: continues with the one job left; the finished ones are kept as they are
    second = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = second.communicate(timeout=600)
    result = subprocess.CompletedProcess(command, second.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "continuing the interrupted reproduction" in result.stdout
    assert "3 of 4 jobs done before, kept" in result.stdout
    jobs = re.findall(r"reproduce: \[(\d+)/(\d+)\] (.*?) \| \S+ so far, about \S+ left", result.stdout)
    assert jobs == [("1", "1", "[ring+fp16+lazy] seed 0 (1 of 1)")], jobs
    assert "ring+fp16+lazy s0 |" in result.stdout
    assert kept.read_bytes() == kept_bytes
    assert json.loads((tmp_path / "runs" / "progress.json").read_text())["finished"] is True
    text = report.read_text()
    table = text[text.index("| strategy | time to target"):].split("\n\n")[0].splitlines()[2:]
    assert [row.split("|")[1].strip() for row in table] == ["allreduce", "ring+fp16+lazy"]
    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 8 and all(cells) and "not reached" not in row and "nan" not in row, row
    assert "Machine:" in text and "Command: `python scripts/reproduce.py" in text and "world size 2" in text
    clocks = text[text.index("| strategy | start-up (s)"):].split("\n\n")[0].splitlines()[2:]
    for row in clocks:  # MLPerf's clock split: start-up + training + evaluation + other = the total
        startup, train, evaluation, other, total, init = (float(c) for c in row.strip("|").split("|")[1:])
        assert startup > 0 and train > 0 and evaluation > 0 and init > 0 and other >= -0.05, row
        assert startup + train + evaluation + other == pytest.approx(total, abs=0.25), row
    parts = text[text.index("| strategy | time to target / allreduce's"):].split("\n\n")[0].splitlines()[2:]
    assert parts[0] == "| allreduce | 1.00x | 1.00x | 1.00x | 1.00x | 1 of 1 |" and len(parts) == 2, parts
    assert "## Convergence: dense against sparse communication" in text and "- Stable recipe:" in text
    assert "| 2 | ring+fp16+lazy |" in text  # the model's check against this run
    measured = text[text.index("| world | ring: bandwidth"):].split("\n\n")[0].splitlines()[2:]
    assert len(measured) == 1 and measured[0].startswith("| 2 |") and "nan" not in measured[0], measured
    builtin = text[text.index("| size | world 2 |"):].split("\n\n")[0].splitlines()[2:]
    assert builtin[0].startswith("| 1 element per rank |") and len(builtin) == 12 and "nan" not in str(builtin)
    alone = text[text.index("| world | builtin: measured"):].split("\n\n")[0].splitlines()[2:]
    assert len(alone) == 1 and alone[0].startswith("| 2 |") and "nan" not in alone[0], alone
    assert "mean over 2 separate launches" in text
    assert "over 2 launches of the same plan, code and machine" in text
    assert "launch 2:" in text and "3 jobs kept" in text
    launches = sorted((tmp_path / "runs" / "netbench").glob("network*.json"))
    assert [p.name for p in launches] == ["network1.json", "network2.json"]
    assert "410.2x" in text
    for figure in ("reproduce_top1.png", "reproduce_top1_epochs.png", "reproduce_step_split.png", "scaling.png"):
        assert (tmp_path / figure).stat().st_size > 1000
    if netemu.why_unavailable() is None:
        assert "each link shaped to" in text
        assert netemu.namespaces(f"{netemu.PREFIX}{second.pid}-") == []  # (another job's may exist)
    else:
        assert "loopback, not emulated" in text


def test_progress_continues_only_the_same_unfinished_plan_and_discards_only_when_told(tmp_path: Path) -> None:
    from gradientflow_repro.reproduction.progress import CannotContinue, Progress

    def kept(plan: dict, runs: Path = tmp_path / "runs", fresh: bool = False, job: str = "") -> int:
        with Progress(runs, plan, fresh) as progress:
            if job:
                progress.record(job, {})
            return progress.kept

    runs = tmp_path / "runs"
    plan = {"world": 4, "rungs": ["ddp"], "code": "abc", "machine": {"cpu": "x", "torch": "2"}}
    with Progress(runs, plan) as first:
        first.record("calibration", {"compute_s": 0.1})
        state = json.loads((runs / Progress.FILE).read_text())  # saved at once, whole
        with pytest.raises(CannotContinue, match="another launch .* is working in"):  # one launch at a time
            Progress(runs, plan)
    (runs / "ddp").mkdir()
    assert state["done"] == {"calibration": {"compute_s": 0.1}} and len(state["launches"]) == 1
    assert state["group"].startswith("reproduce-")

    with Progress(runs, json.loads(json.dumps(plan))) as again:  # the same plan, through JSON: continued
        assert again.kept == 1 and again.done("calibration") == {"compute_s": 0.1}
        assert again.done("netbench w4") is None and again.state["group"] == state["group"]
    assert (runs / "ddp").is_dir() and len(json.loads((runs / Progress.FILE).read_text())["launches"]) == 2

    for changed, said in [({**plan, "world": 8}, "another world (4, now 8)"),
                          ({**plan, "code": "def"}, "another code (abc, now def"),
                          ({**plan, "machine": {"cpu": "y", "torch": "2"}}, "another machine.cpu ('x', now 'y')"),
                          ({**plan, "code": None}, "another code (abc, now None"),
                          ({**plan, "extra": 1}, "another extra (None, now 1)")]:
        with pytest.raises(CannotContinue, match=re.escape(said) + ".*--fresh"):
            Progress(runs, changed)
        assert (runs / "ddp").is_dir() and kept(plan) == 1  # untouched, still continuable

    unknown = {**plan, "code": None}  # where git cannot say which code, nothing continues
    kept(unknown, tmp_path / "nogit", job="calibration")
    with pytest.raises(CannotContinue, match="git cannot say"):
        kept(unknown, tmp_path / "nogit")

    with Progress(runs, plan) as finished:
        finished.finish()
    assert kept(plan) == 0 and not (runs / "ddp").exists()  # finished: done again
    kept(plan, job="calibration")
    assert kept({**plan, "world": 8}, fresh=True) == 0  # --fresh discards another plan's
    (runs / Progress.FILE).write_text("{not json")
    with pytest.raises(CannotContinue, match="cannot be read"):
        kept(plan)
    assert kept(plan, fresh=True) == 0


def test_a_measured_network_sets_the_switch_over_to_the_ring_of_our_own_algorithms_only() -> None:
    """The network of the 4-rank reproduction on cdc5ef8 (29.1 MB/s, 1231 us per message): recursive
    doubling up to 256 KiB (it sends 4/3 of the ring's bytes at four ranks, in a third of its steps:
    equal at 8 a B = 287 KB), so CSC's payload of about 460 KB goes by the ring; at two ranks both
    send the same bytes and recursive doubling has fewer steps, so the model never prefers the ring:
    the default (measured on loopback) caps it, and a `ring` rung still sends large messages by the ring."""
    from gradientflow_repro.scaling.netbench import small_message_kb

    measured = {"bandwidth_Bps": 29.1e6, "latency_s": 1231e-6}
    assert small_message_kb(4, measured) == 256 and small_message_kb(2, measured) == 1024  # the default caps it
    assert small_message_kb(4, {"bandwidth_Bps": 1e12, "latency_s": 0.0}) == 1  # the ring from the smallest
    assert knobs.on_network(lineup.COMPARED["gradientflow"], 256) == {"strategy": "gradientflow",
                                                                     "small_message_kb": 256}
    assert knobs.on_network(lineup.COMPARED["ring+fp16"], 256)["small_message_kb"] == 256
    for builtin in ("allreduce", "ddp"):
        assert knobs.on_network(lineup.COMPARED[builtin], 256) == lineup.COMPARED[builtin]
    assert knobs.on_network(lineup.COMPARED["gradientflow"], None) == lineup.COMPARED["gradientflow"]


def test_check_world_sizes_default_to_2_unless_it_is_the_ladders_and_never_repeat() -> None:
    from gradientflow_repro.reproduction.reproduce import check_worlds_for

    assert check_worlds_for(4, None) == [2] and check_worlds_for(2, None) == []  # make reproduce NPROC=2
    assert check_worlds_for(4, (3, 2)) == [3, 2] and check_worlds_for(4, ()) == []
    for given in [(4,), (2, 2)]:
        with pytest.raises(ValueError, match="each once, and not the ladder's world size 4"):
            check_worlds_for(4, given)


def test_a_reproduction_interrupted_at_any_job_continues_to_the_same_result(tmp_path: Path, monkeypatch,
                                                                            capsys: pytest.CaptureFixture) -> None:
    """Every job of a small plan (two world sizes checked), with launches and measurements faked:
    stopped at job k, the next launch runs job k and those after it, once each, and ends with the
    facts of an uninterrupted reproduction; stopped while writing the report, it trains nothing again."""
    from gradientflow_repro.provenance import code_version
    from gradientflow_repro.reproduction import reproduce as rp
    from gradientflow_repro.scaling.netbench import small_message_kb

    if code_version() is None:
        pytest.skip("git cannot say which code this is: nothing can be continued")
    ran: list[str] = []
    stop_at: list = [None]

    def job(name: str) -> None:
        ran.append(name)
        if name == stop_at[0]:
            raise KeyboardInterrupt

    class fake_network:  # the emulated network, as the launches see it: its rate
        def __init__(self, world, rate_mbit, reason, ranks_per_node=1):
            self.rate = rate_mbit

        def __enter__(self):
            return self.rate

        def __exit__(self, *exc):
            return None

    def fake_run_ranks(world, overrides, run_dir, label, net, timeout_s, show=True):
        run_dir.mkdir(parents=True)  # begin() emptied it: a cut-short attempt left nothing behind
        argv = [o.replace(str(run_dir), "RUN_DIR") for o in overrides]
        (run_dir / "summary.json").write_text(json.dumps({"label": label, "world": world, "argv": argv,
                                                          "rate": net}))
        job(f"{label} {run_dir.name}")

    def fake_calibrate(world, base, run_dir, net, timeout_s):
        job("calibration")
        return {"compute_s": 0.05, "bytes_per_step": 1e6, "step_s": 0.1, "profile": {"tensors": [[100, 0, 0]]}}

    def fake_measure(world, net, run_dir, timeout_s, gradients, launches):
        job(f"netbench {world}")
        return {"bandwidth_Bps": 1e8 * world, "latency_s": 1e-4}

    def fake_report(runs_dir, report):
        job("report")
        report.write_text(json.dumps(json.loads((runs_dir / "reproduce.json").read_text()), sort_keys=True))

    monkeypatch.setattr(rp, "run_ranks", fake_run_ranks)
    monkeypatch.setattr(rp, "network", fake_network)
    monkeypatch.setattr(rp.netemu, "why_unavailable", lambda: None)
    monkeypatch.setattr(rp, "calibrate", fake_calibrate)
    monkeypatch.setattr(rp, "measure_network", fake_measure)
    monkeypatch.setattr(rp, "report_from", fake_report)
    monkeypatch.setattr(rp, "load_run", lambda run_dir: json.loads((run_dir / "summary.json").read_text()))
    monkeypatch.setattr(rp, "median_step", lambda runs, skip_warmup=True: {"runs": runs})
    monkeypatch.setattr(rp.time, "strftime", lambda *args: "20260101-000000")  # one wandb group name for all

    def launch(name: str) -> dict:
        rp.reproduce(world=4, check_worlds=(2, 3), repeats=2, rungs=("allreduce", "gradientflow"), rate_mbit=100,
                     check_repeats=2, runs_dir=tmp_path / name, report=tmp_path / f"{name}.json")
        facts = json.loads((tmp_path / f"{name}.json").read_text())
        return {key: value for key, value in facts.items() if key not in ("elapsed_s", "launches", "machine")}

    reference, every_job = launch("whole"), list(ran)
    assert "was not planned there" not in capsys.readouterr().out  # jobs ran in the order planned
    # calibration, network, 2 x 2 runs to the target, 2 short runs of the sparse rung at world size 4
    # with 2 of allreduce beside them, as many with the links unshaped, then at world sizes 2 and 3 a
    # network measurement and 2 x 2 short runs each, the report
    assert len(every_job) == 1 + 1 + 4 + 4 + 4 + 2 * (1 + 4) + 1 and every_job[-1] == "report"
    short = [job for job in every_job if " w4 " in job or job.endswith(" w4")][:4]
    assert [job.split()[0] for job in short] == ["allreduce", "gradientflow"] * 2  # side by side, repeat-major
    at_ladder = reference["checks"]["4"]
    assert [run["label"] for run in at_ladder["allreduce"]["runs"]] == ["allreduce s0", "allreduce s1"]
    assert [run["label"] for run in at_ladder["gradientflow"]["runs"]] == ["gradientflow w4"] * 2
    beside = reference["allreduce_beside"]["4"]["runs"]  # the compute-only step beside them
    assert [run["label"] for run in beside] == ["allreduce w4"] * 2
    assert all("comm.csc_warmup_epochs=0" in run["argv"] for run in [*at_ladder["gradientflow"]["runs"], *beside])
    assert {run["rate"] for world in reference["checks"].values() for runs in world.values()
            for run in runs["runs"]} == {run["rate"] for run in beside} == {100}
    for label, runs in (("gradientflow", at_ladder["gradientflow"]["runs"]), ("allreduce", beside)):
        free = reference["unshaped"]["4"][label]["runs"]  # the same runs, the links without a rate
        assert [run["rate"] for run in free] == [None, None]
        assert [run["argv"] for run in free] == [run["argv"] for run in runs]
    # our algorithms switch to the ring where the model prices the network measured at that world
    # size (4 x 10^8 B/s, 100 us: 8 a B = 320 KB at four ranks, so 256 KiB); gloo's allreduce is left alone
    for world in ("4", "2", "3"):
        switch = reference["network_by_world"][world]["small_message_kb"]
        assert switch == small_message_kb(int(world), {"bandwidth_Bps": 1e8 * int(world), "latency_s": 1e-4})
        for label, runs in reference["checks"][world].items():
            said = [o for run in runs["runs"] for o in run["argv"] if o.startswith("comm.small_message_kb=")]
            assert said == ([] if label == "allreduce" else [f"comm.small_message_kb={switch}"] * 2), (world, label)
    assert reference["network_by_world"]["4"]["small_message_kb"] == 256
    assert reference["short_at_world"] == ["gradientflow"]
    for index, stopped in enumerate(every_job):
        ran.clear()
        stop_at[0] = stopped
        with pytest.raises(KeyboardInterrupt):
            launch(f"cut{index}")
        assert ran == every_job[:index + 1]
        ran.clear()
        stop_at[0] = None
        assert launch(f"cut{index}") == reference, stopped
        assert ran == every_job[index:], stopped  # the one cut short and those after it, once each
        state = json.loads((tmp_path / f"cut{index}" / "progress.json").read_text())
        assert state["finished"] and [launch["kept_jobs"] for launch in state["launches"]] == [0, index]


def test_the_runs_train_the_whole_schedule_and_patterns_default_configurations_plan_no_step_time_runs(
        tmp_path: Path, monkeypatch) -> None:
    """Every training run has no target to stop at (``target_top1=null``, after every override); the
    target it is measured against is the experiment's, or the one the overrides set. patterns_cpu
    trains its own default configurations, without `allreduce`, so no step-time run and no other
    world size is planned (nothing the model could be checked against); digits_cpu trains every one."""
    from gradientflow_repro.reproduction import reproduce as rp
    from gradientflow_repro.reproduction.convergence import experiment_target

    launched: list[tuple[str, list[str]]] = []

    class fake_network:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    def fake_run_ranks(world, overrides, run_dir, label, net, timeout_s, show=True):
        run_dir.mkdir(parents=True)
        launched.append((label, list(overrides)))

    monkeypatch.setattr(rp, "run_ranks", fake_run_ranks)
    monkeypatch.setattr(rp, "network", fake_network)
    monkeypatch.setattr(rp.netemu, "why_unavailable", lambda: None)
    monkeypatch.setattr(rp, "calibrate", lambda *args: {"compute_s": 0.05, "bytes_per_step": 1e6, "step_s": 0.1,
                                                        "profile": {"tensors": [[100, 0, 0]]}})
    monkeypatch.setattr(rp, "measure_network", lambda world, *args: {"bandwidth_Bps": 1e8, "latency_s": 1e-4,
                                                                      "world": world})
    monkeypatch.setattr(rp, "report_from", lambda runs_dir, report: report.write_text(
        (runs_dir / "reproduce.json").read_text()))
    monkeypatch.setattr(rp, "load_run", lambda run_dir: {"run_dir": str(run_dir)})
    monkeypatch.setattr(rp, "median_step", lambda runs, skip_warmup=True: {})

    def facts(name: str, *overrides: str) -> dict:
        launched.clear()
        rp.reproduce(experiment="patterns_cpu", repeats=1, rate_mbit=100, runs_dir=tmp_path / name,
                     report=tmp_path / f"{name}.json", overrides=overrides)
        return json.loads((tmp_path / f"{name}.json").read_text())

    made = facts("default")
    assert made["rungs"] == list(rp.DEFAULT_RUNGS["patterns_cpu"]) and "allreduce" not in made["rungs"]
    assert [label for label, _ in launched] == [f"{label} s0" for label in made["rungs"]]  # no step-time run
    assert made["checks"] == {"4": {}} and list(made["network_by_world"]) == ["4"]  # no other world size
    assert made["target_top1"] == experiment_target("patterns_cpu")
    assert all(argv[argv.index("target_top1=null") + 1].startswith("seed=") for _, argv in launched)
    told = facts("told", "target_top1=70")  # measured against 70%, still never stopped at it
    assert told["target_top1"] == 70.0
    for _, argv in launched:
        assert argv.index("target_top1=70") < argv.index("target_top1=null")  # the later one wins
    assert rp.default_rungs("digits_cpu") == list(lineup.COMPARED)
    assert set(rp.DEFAULT_RUNGS["patterns_cpu"]) <= set(lineup.COMPARED)


# ---------------------------------------------------------------- the report's arithmetic
def _fake_run(strategy: str, seed: int, curve: list[float], step_s: float = 0.1, startup_s: float = 2.0,
              target: float = 97.0, steps_per_epoch: int = 10, density: float = 0.1) -> dict:
    """A finished run as ``runs.load_run`` returns it: evaluations after every epoch, stopped at the
    target (or at the end of ``curve``)."""
    reached = next((i + 1 for i, top1 in enumerate(curve) if top1 >= target), None)
    epochs = reached or len(curve)
    records, clock = [], startup_s
    for epoch in range(1, epochs + 1):
        clock += steps_per_epoch * step_s + 0.5
        records.append({"kind": "eval", "epoch": float(epoch), "top1": curve[epoch - 1], "mlperf_s": clock})
    steps = epochs * steps_per_epoch
    at = ({"step": steps, "mlperf_s": clock, "train_s": steps * step_s, "eval_s": 0.5 * epochs,
           "startup_s": startup_s, "init_s": 3.0} if reached else None)
    comm = {"strategy": strategy, **({"density": density} if strategy == "gradientflow" else {})}
    return {"summary": {"reached_target": bool(reached), "clocks_at_target": at, "steps": steps, "epochs": epochs,
                        "target_top1": target, "final_top1": curve[epochs - 1], "best_top1": max(curve[:epochs])},
            "records": records, "config": {"seed": seed, "eval_every_epochs": 1, "optim": {"warmup_epochs": 1}},
            "comm": comm}


def test_the_report_splits_gradientflows_gap_into_the_links_rate_and_the_rest() -> None:
    """gradientflow's step over the compute-only step, and with the links unshaped the part the link's
    rate accounts for; the note on ranks sharing cores only where they do. The network table says
    where recursive doubling hands over to the ring (the default for a network measured before)."""
    from report_words import _hidden_communication, _network_table

    checks = {4: {"allreduce": {"step_s": 0.5, "sync_wait_s": 0.3, "behind_slowest_s": 0.04},
                  "gradientflow": {"step_s": 0.3, "behind_slowest_s": 0.05}}}
    unshaped = {4: {"gradientflow": {"step_s": 0.25, "step_s_each": [0.24, 0.26]}}}
    text = "\n".join(_hidden_communication(checks, unshaped, cores=2))
    assert "`gradientflow`'s step is 1.50x the compute-only step (200.0 ms" in text and "NOT met" in text
    assert "unshaped (no rate limit; 2 short runs, the same settings): 250.0 ms, 1.25x" in text
    assert "the link's rate accounts for +0.25x" in text and "With 4 ranks on 2 cores" in text
    assert ("The slowest rank's forward and backward took 40.0 ms and 50.0 ms longer than rank 0's per step "
            "(median; in `allreduce`'s and `gradientflow`'s runs)") in text
    del checks[4]["allreduce"]["behind_slowest_s"]  # a run from before it was logged: said for the rest
    assert "took 50.0 ms longer than rank 0's per step (median; in `gradientflow`'s runs)" in "\n".join(
        _hidden_communication(checks, unshaped, cores=2))
    assert "cores" not in "\n".join(_hidden_communication(checks, unshaped, cores=8))
    assert "unshaped" not in "\n".join(_hidden_communication(checks, {}, cores=2))
    # gradientflow's short runs at the ladder's world size, set against allreduce's short runs beside
    # them (shaped and unshaped), not against allreduce's runs to the target
    beside = {4: {"step_s": 0.45, "sync_wait_s": 0.2, "behind_slowest_s": 0.03}}
    unshaped[4]["allreduce"] = {"step_s": 0.25, "sync_wait_s": 0.05}
    text = "\n".join(_hidden_communication(checks, unshaped, 2, beside, {4: ["gradientflow"]}))
    assert "1.20x the compute-only step (250.0 ms: `allreduce`'s step less its wait, in runs beside" in text
    assert "Goal at most 1.2x: met" in text and "took 30.0 ms and 50.0 ms longer" in text
    assert ("250.0 ms, 1.00x the compute-only step (`allreduce`'s compute-only step in the unshaped runs beside "
            "them: 200.0 ms, against 250.0: how far") in text
    assert "the link's rate accounts for +0.20x" in text
    old = "\n".join(_hidden_communication(checks, {}, 2, {}, {4: ["gradientflow"]}))  # before they were made
    assert "1.50x the compute-only step (200.0 ms: `allreduce`'s step less its wait, in its runs to the target" in old
    rows = _network_table({2: {"bandwidth_Bps": 3e7, "latency_s": 1e-3, "small_message_kb": 1024},
                           4: {"bandwidth_Bps": 3e7, "latency_s": 1e-3, "small_message_kb": 256},
                           8: {"bandwidth_Bps": 3e7, "latency_s": 1e-3}})[2:5]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == ["1 MiB", "256 KiB", "1 MiB (default)"]


def test_the_model_runs_on_the_slowest_ranks_clock_of_the_allreduce_runs_beside_each_strategy() -> None:
    """The model's compute at a world size is allreduce's step less its wait plus how much longer its
    slowest rank's forward and backward took (every collective after backward waits for it); for a
    rung with short runs at the ladder's world size, that of allreduce's short runs beside them."""
    from report_words import model_check

    calibration = {"profile": {"forward_s": 0.01, "backward_s": 0.02, "optimizer_s": 0.0,
                               "tensors": [[40000, 0.02, False], [100, 0.02, True]]}}
    network = {4: {"bandwidth_Bps": 1e8, "latency_s": 1e-4}}

    def predicted(checks: dict, *beside: dict) -> dict[str, float]:
        rows = [row.split("|") for row in model_check(checks, calibration, network, False, None, 2, *beside)
                if row.startswith("| 4 |")]
        return {cells[2].strip(): float(cells[4]) for cells in rows}

    allreduce = {"step_s": 0.5, "sync_wait_s": 0.3, "behind_slowest_s": 0.04}
    checks = {4: {"allreduce": allreduce, "gradientflow": {"step_s": 0.3}}}
    slowest = predicted(checks)
    del allreduce["behind_slowest_s"]  # (a run from before it was logged: rank 0's compute)
    rank0 = predicted(checks)
    assert slowest["allreduce"] - rank0["allreduce"] == pytest.approx(40.0, abs=0.15)  # after backward: all of it
    assert slowest["gradientflow"] > rank0["gradientflow"]
    beside = {4: {"step_s": 0.3, "sync_wait_s": 0.15, "behind_slowest_s": 0.01}}  # 160 ms against 200
    shorts = predicted(checks, beside, {4: ["gradientflow"]})
    assert shorts["allreduce"] == rank0["allreduce"]  # the dense rungs keep allreduce's runs to the target
    # the short runs beside are checked too, on their own compute: 160 ms against 200
    assert shorts["allreduce (short runs)"] == pytest.approx(rank0["allreduce"] - 40.0, abs=0.15)
    assert shorts["gradientflow"] < rank0["gradientflow"] - 30
    assert predicted(checks, beside, {}) == {**rank0, "allreduce (short runs)": 163.6}  # beside nothing
    # a per-rank batch twice the profile's: forward and backward take twice as long, the work per
    # gradient element (optimizer, CSC's local work) does not
    calibration["profile"].update(sparsify_s_per_element=1e-7, optimizer_s=0.005, batch=16)
    flat, by_batch = predicted(checks), predicted(checks, None, None, 128)  # 128 / 4 ranks = 2 x 16
    assert by_batch["allreduce"] == pytest.approx(flat["allreduce"], abs=0.15)  # its compute is measured
    assert by_batch["gradientflow"] < flat["gradientflow"] - 1  # its local work is not batch work
    # the optimizer's plain step is what a rung under CSC's momentum correction pays instead of the whole
    # one (test_csc_under_momentum_correction_pays_the_optimizers_plain_step); `gradientflow` runs
    # without it, so its prediction, like allreduce's, does not move
    calibration["profile"]["plain_optimizer_s"] = 0.001
    plain = predicted(checks, None, None, 128)
    assert plain["gradientflow"] == by_batch["gradientflow"]
    assert plain["allreduce"] == by_batch["allreduce"]
    profile = pm.ModelProfile(0.01, 0.02, 0.005, (pm.TensorProfile(100, 0.02),), 1e-9, 2e-9, 0.001)
    assert profile.scaled(4.0, 2.0) == pm.ModelProfile(0.04, 0.08, 0.01, (pm.TensorProfile(100, 0.08),),
                                                       2e-9, 4e-9, 0.002)


def test_a_steady_step_is_the_median_interval_after_the_warmup_and_says_what_was_logged() -> None:
    """Intervals that begin at or after the warm-up, their medians; the wait for the slowest rank
    where every interval logged it (runs from before it was logged have none, and their repeats
    leave it out of the median over repeats)."""
    from gradientflow_repro.reproduction.runs import median_step, steady_step

    def interval(epoch: float, step_s: float, behind: "float | None" = None) -> dict:
        return {"kind": "train", "epoch": epoch, "step_s": step_s, "sync_wait_s_per_step": step_s / 4,
                "bytes_per_step": 100, **({} if behind is None else {"behind_slowest_s_per_step": behind})}

    new = {"records": [interval(1, 9.0, 0.5), interval(2, 1.0, 0.1), interval(3, 3.0, 0.3), interval(4, 2.0, 0.2)]}
    assert steady_step(new, after_epoch=1) == {"step_s": 2.0, "sync_wait_s": 0.5, "bytes_per_step": 100,
                                               "behind_slowest_s": 0.2}
    old = {"records": [interval(1, 4.0), interval(2, 4.0)]}
    assert "behind_slowest_s" not in steady_step(old)
    both = median_step([new, old], skip_warmup=False)
    assert "behind_slowest_s" not in both and both["step_s_each"] == [2.5, 4.0]


def test_the_speedup_decomposes_into_step_time_epochs_and_overhead() -> None:
    from report_words import decomposition

    runs = {"ddp": [_fake_run("ddp", s, [90, 95, 98], step_s=0.2) for s in range(3)],
            "gradientflow": [_fake_run("gradientflow", s, [90, 94, 96, 98], step_s=0.05) for s in range(3)]}
    parts = decomposition(runs, "ddp")
    assert parts["ddp"] == {"time": 1.0, "step": 1.0, "epochs": 1.0, "overhead": 1.0}
    gf = parts["gradientflow"]
    assert gf["step"] == pytest.approx(0.25) and gf["epochs"] == pytest.approx(4 / 3)
    # ddp: 2 + 3 x (10 x 0.2 + 0.5) = 9.5 s; gradientflow: 2 + 4 x (10 x 0.05 + 0.5) = 6 s
    assert gf["time"] == pytest.approx(6 / 9.5)
    assert gf["step"] * gf["epochs"] * gf["overhead"] == pytest.approx(gf["time"])
    assert gf["overhead"] > 1  # start-up and evaluation weigh more on the shorter run


def test_the_decomposition_states_the_floor_of_the_step_ratio() -> None:
    from report_words import _decomposition_section

    runs = {"ddp": [_fake_run("ddp", s, [90, 95, 98], step_s=0.2) for s in range(3)],
            "gradientflow": [_fake_run("gradientflow", s, [90, 94, 96, 98], step_s=0.05) for s in range(3)]}
    checks = {"allreduce": {"step_s": 0.3, "sync_wait_s": 0.22}, "ddp": {"step_s": 0.2, "sync_wait_s": 0.1}}
    text = "\n".join(_decomposition_section(runs, checks))
    # compute-only 80 ms = 0.40x ddp's 200 ms step; overhead 6 / 9.5 / (0.25 x 4/3) = 1.89
    assert "(80.0 ms, `allreduce`'s step less its wait" in text and "0.40x `ddp`'s step (200.0 ms)" in text
    assert f"0.40x x 1.89x = {0.4 * (6 / 9.5) / (0.25 * 4 / 3):.2f}x" in text
    assert "floor" not in "\n".join(_decomposition_section(runs))  # no ladder checks: no floor stated


def test_the_report_names_falls_after_warmup_and_dense_disagreement() -> None:
    from report_words import convergence_table, dense_agreement, falls_after_warmup

    runs = {"allreduce": [_fake_run("allreduce", 0, [50, 96, 98]), _fake_run("allreduce", 1, [40, 80, 98])],
            "ddp": [_fake_run("ddp", 0, [50, 90, 84, 98]), _fake_run("ddp", 1, [20, 85, 97])],
            "gradientflow": [_fake_run("gradientflow", 0, [30, 60, 90, 95, 96]),
                             _fake_run("gradientflow", 1, [30, 60, 90, 97])]}
    # a fall during the warm-up (epoch 1) is allowed; ddp seed 0's 90 -> 84 is not
    assert falls_after_warmup(runs, warmup_epochs=1.0) == ["ddp seed 0: epoch 2 -> 3: 90.0% -> 84.0%"]
    falling = {"a": [_fake_run("ddp", 0, [60, 20, 98])]}
    assert falls_after_warmup(falling, warmup_epochs=1.0) == ["a seed 0: epoch 1 -> 2: 60.0% -> 20.0%"]
    assert falls_after_warmup(falling, warmup_epochs=2.0) == []  # evaluated at the end of the warm-up: allowed
    assert dense_agreement(runs) == {0: [3.0, 4.0], 1: [3.0, 3.0]}  # gradientflow is not dense
    table, budget = convergence_table(runs)
    assert budget == 3  # the last epoch every run was evaluated at (allreduce stops there)
    rows = {row.split("|")[1].strip(): row for row in table[2:]}
    assert "| 0.1 | not reached (1 of 2 not reached)" not in rows["gradientflow"]
    assert rows["gradientflow"].split("|")[3].strip() == "4 (1 of 2 not reached)"
    # of them sparse: after the dense warm-up, the learning rate's (1 epoch here); dense runs have none
    assert rows["gradientflow"].split("|")[4].strip() == "3 (1 of 2 not reached)"
    assert rows["ddp"].split("|")[4].strip() == "-"
    assert rows["ddp"].split("|")[5].strip() == "90.5 [84.0-97.0]"


def test_the_report_says_how_many_epochs_to_target_were_sparse() -> None:
    """The epochs goal is stated with how many of the sparse strategy's epochs sent sparsely (after
    its dense warm-up, the learning rate's: 1 epoch in these runs); a target reached within one sparse
    epoch is called out, since it then says little about what sparse communication costs."""
    from report_words import _convergence_section

    ddp = [_fake_run("ddp", s, [80, 95, 98]) for s in range(3)]
    slow = {"ddp": ddp, "gradientflow": [_fake_run("gradientflow", s, [80, 90, 95, 98]) for s in range(3)]}
    text = "\n".join(_convergence_section(slow))
    assert ("`gradientflow` (density 0.1, no momentum correction): 4 epochs to target against 3 for dense training "
            "(medians): +33%, "
            "3 of them sparse, after 1 dense. Goal at density 0.1: within 10%: NOT met.") in text
    assert "say little" not in text
    quick = {"ddp": ddp, "gradientflow": [_fake_run("gradientflow", s, [80, 98]) for s in range(3)]}
    text = "\n".join(_convergence_section(quick))
    assert "-33%, 1 of them sparse, after 1 dense. Goal at density 0.1: within 10%: met." in text
    assert "- `gradientflow`: at most one sparse epoch before the target (median)" in text
    # a warm-up of 1.5 epochs leaves 2.5 of 4 sparse: said as it is, not rounded to 2 or 3
    half = [_fake_run("gradientflow", s, [80, 90, 95, 98]) for s in range(3)]
    for run in half:
        run["config"]["optim"]["warmup_epochs"] = 1.5
    text = "\n".join(_convergence_section({"ddp": ddp, "gradientflow": half}))
    assert "+33%, 2.5 of them sparse, after 1.5 dense." in text


def test_the_timeline_counts_jobs_and_estimates_the_time_left(capsys: pytest.CaptureFixture, monkeypatch) -> None:
    from gradientflow_repro import logs
    from gradientflow_repro.reproduction import progress

    logs.configure()  # the library logs its progress lines; a program shows them (on stdout)
    now = [1000.0]
    monkeypatch.setattr(progress.time, "time", lambda: now[0])
    timeline = progress.Timeline([("train", "a"), ("train", "b"), ("train", "a"), ("check", "a w2")])
    timeline.begin("train", "a", "a seed 0")
    now[0] += 60  # a took a minute
    timeline.begin("train", "b", "b seed 0")
    now[0] += 20  # b took 20 s
    timeline.begin("train", "a", "a seed 1")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"reproduce: [1/4] a seed 0 | 0s so far, about {progress.duration(2 * 30 + 30 + 12)} left"
    # b: no b yet, so the trainings' mean (60 s); a: 60 s; the check: its guess (12 s)
    assert lines[1] == "reproduce: [2/4] b seed 0 | 1m00s so far, about 2m12s left"
    assert lines[2] == "reproduce: [3/4] a seed 1 | 1m20s so far, about 1m12s left"  # a as a took: 60 s
    timeline.begin("train", "a", "not planned")  # job 4 was to be the check: said, not fatal
    assert capsys.readouterr().out.splitlines() == [
        "reproduce: job 4 (train a) was not planned there: time left unknown",
        "reproduce: [4/4] not planned | 1m20s so far, about ? left"]


# ---------------------------------------------------------------- accuracy over the whole schedule
def test_the_convergence_study_sets_sparse_against_dense_seed_by_seed(tmp_path: Path) -> None:
    from gradientflow_repro.reproduction.convergence import write_study

    never = 101.0  # full curves: the study's runs never stop at a target
    runs = {"ddp": [_fake_run("ddp", 0, [90, 97, 99.5, 99], target=never),
                    _fake_run("ddp", 1, [91, 97.5, 98, 98.5], target=never)],
            # seed 1 first: pairing by position instead of by seed would set it against ddp's seed 0
            "gradientflow": [_fake_run("gradientflow", 1, [80, 95, 89, 98], target=never),
                             _fake_run("gradientflow", 0, [85, 93, 97, 98.5], target=never)],
            "late": [_fake_run("ddp", 0, [50, 70, 60, 98], target=never)]}
    runs["late"][0]["config"]["optim"] = {"warmup_epochs": 3}  # its fall at epoch 3 is inside its warm-up
    out = tmp_path / "convergence.md"
    machine = {"gpu": None, "cpu": "test CPU", "cpu_count": 2, "torch": "x", "git_commit": "abc"}
    configs = {"ddp": ["comm=ddp"], "gradientflow": ["comm=gradientflow"], "late": ["comm=ddp"]}
    write_study(out, runs, configs=configs, targets=[97.0, 98.0], world=4, experiment="digits_cpu", command="c",
                elapsed_s=60, kept=1, overrides=[], machine=machine)
    text = out.read_text()
    rows = {row.split("|")[1].strip(): [c.strip() for c in row.strip("|").split("|")]
            for row in text[text.index("| configuration | density"):].split("\n\n")[0].splitlines()[2:]}
    # epochs to 97% and 98%, top-1 at the end, best, largest fall after the warm-up (1 epoch)
    assert rows["ddp"][1:] == ["1 (dense)", "2 [2-2]", "3 [3-3]", "98.75 [98.50-99.00]", "- (the reference)",
                               "99.00 [98.50-99.50]", "0.2 [0.0-0.5]"]  # seed 0 ends 0.5 below its best
    assert rows["gradientflow"][1:] == ["0.1", "3.5 [3-4]", "4 [4-4]", "98.25 [98.00-98.50]",
                                        "seed 1 -0.50, seed 0 -0.50", "98.25 [98.00-98.50]", "3.0 [0.0-6.0]"]
    per_epoch = text[text.index("| configuration | 1 | 2 | 3 | 4 |"):].split("\n\n")[0].splitlines()
    assert per_epoch[3] == "| gradientflow | 82.5 | 94.0 | 93.0 | 98.2 |"  # 98.25, rounded half to even
    assert rows["late"][1:] == ["1 (dense)", "4", "4", "98.00", "seed 0 -1.00", "98.00", "0.0"]
    assert ("Falls of more than 5 points from one evaluation to the next after the warm-up: 1 in 5 runs: "
            "gradientflow seed 1: epoch 2 -> 3: 95.0% -> 89.0%.") in text
    # seed by seed: 98.5 - 99 and 98 - 98.5; the dense runs' own spread 0.5
    assert ("Against `ddp` (dense): epochs to 97% as medians over the seeds that reached it (`ddp`: 2 of 2), "
            "top-1 at the end seed by seed:\n- `gradientflow`: 3.5 epochs to 97% against 2 (+75%); top-1 at the end "
            "-0.50 points against the same seed's dense run (from -0.50 to -0.50 over 2 seeds; the dense runs' own "
            "spread over the seeds: 0.50).\n\n") in text
    assert "1 of 5 runs kept from an earlier launch" in text
    assert (tmp_path / "convergence_top1.png").stat().st_size > 1000


def test_the_convergence_study_refuses_unknown_configurations() -> None:
    from gradientflow_repro.reproduction.convergence import experiment_target, parse_configs

    assert parse_configs(["ddp", "cap0=comm=gradientflow comm.release_cap=0"]) == {
        "ddp": ["comm=ddp"], "cap0": ["comm=gradientflow", "comm.release_cap=0"]}
    assert parse_configs(["gradientflow@0.01"])["gradientflow@0.01"] == ["comm=gradientflow", "comm.density=0.01"]
    with pytest.raises(ValueError, match="'gradientflw': not one of allreduce, ddp"):
        parse_configs(["gradientflw"])
    for label in ("", "..", "a/b", "x y", "a,b"):
        with pytest.raises(ValueError, match="must be a plain name"):
            parse_configs([f"{label}=comm=ddp"])
    with pytest.raises(ValueError, match="'ddp' given twice"):
        parse_configs(["ddp", "ddp=comm=ddp"])
    with pytest.raises(ValueError, match="'t': 'target_top1=90': the study never stops at a target"):
        parse_configs(["t=comm=ddp target_top1=90"])
    assert experiment_target("digits_cpu") == 98.5
    with pytest.raises(ValueError, match="experiment 'digits': no configs/experiment/digits.yaml"):
        experiment_target("digits")


def test_the_convergence_study_runs_whole_schedules_and_continues_where_it_stopped(tmp_path: Path,
                                                                                   digits_root: Path) -> None:
    command = [sys.executable, "scripts/convergence.py", "--world", "2", "--seeds", "0", "--configs", "ddp",
               "nomc=comm=gradientflow comm.momentum_correction=false comm.momentum_masking=false",
               "--targets", "20", "--runs-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "c.md"), "--",
               f"data.root={digits_root}", "model.width=0.125", "epochs=3", "optim.warmup_epochs=1",
               "comm.csc_warmup_epochs=0"]

    def study() -> str:
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    first = study()
    jobs = re.findall(r"convergence: \[(\d/\d)\] (.*?) \|", first)
    assert jobs == [("1/2", "[ddp] seed 0"), ("2/2", "[nomc] seed 0")], first
    text = (tmp_path / "c.md").read_text()
    rows = text[text.index("| configuration | density"):].split("\n\n")[0].splitlines()[2:]
    assert [row.split("|")[1:4] for row in rows] == [[" ddp ", " 1 (dense) ", " 1 "], [" nomc ", " 0.1 ", " 1 "]]
    # the target (20%) is reached after epoch 1, and the runs went on to the end of their 3 epochs
    assert "| configuration | 1 | 2 | 3 |" in text and "nomc: `comm=gradientflow comm.momentum_correction=false" in text
    assert "kept from an earlier launch" not in text
    for label in ("ddp", "nomc"):  # whole schedules, past the target
        summary = json.loads((tmp_path / "runs" / label / "seed0" / "summary.json").read_text())
        assert summary["epochs"] == 3 and summary["stopped_by"] is None and summary["target_top1"] is None, summary
    second = study()
    assert "2 of 2 runs kept from before" in second and "[1/" not in second  # both kept: nothing trains
    (tmp_path / "runs" / "nomc" / "seed0" / "summary.json").unlink()  # as if cut short
    again = study()
    assert "1 of 2 runs kept from before" in again and re.findall(r"\[(\d/\d)\] (.*?) \|", again) == [
        ("1/1", "[nomc] seed 0")]
    assert "1 of 2 runs kept from an earlier launch" in (tmp_path / "c.md").read_text()
    command[command.index("--targets") - 1] += " comm.release_cap=2"  # nomc changed: trained again
    changed = study()
    assert "1 of 2 runs kept from before" in changed and "[1/1] [nomc] seed 0" in changed


def test_a_cpu_that_emulates_bf16_trains_the_comparison_in_fp32(monkeypatch, capsys) -> None:
    from gradientflow_repro import logs, precision
    from gradientflow_repro.config import PrecisionConfig
    from gradientflow_repro.reproduction.reproduce import machine_overrides

    logs.configure()  # the line is logged; a program shows it (on stdout)
    monkeypatch.setattr(precision, "native_bf16", lambda device: False)
    assert machine_overrides(["+experiment=digits_cpu"]) == ["precision=fp32"]  # digits_cpu: bf16 autocast on the CPU
    assert capsys.readouterr().out == ""  # said only by a program that adapts its runs
    assert machine_overrides(["+experiment=digits_cpu"], program="study") == ["precision=fp32"]
    assert capsys.readouterr().out.startswith("study: this CPU emulates bf16")
    assert machine_overrides(["+experiment=digits_cpu", "precision=fp32"], program="study") == []
    assert machine_overrides(["+experiment=resnet50_512gpu"], program="study") == []  # fp16 on GPUs: not bf16
    assert capsys.readouterr().out == ""
    assert machine_overrides(["+experiment=digits_cpu", "model.width=0.125"]) == ["precision=fp32"]
    assert machine_overrides(["+experiment=digits_cpu", "precision=bf16"]) == []  # asked for by name: kept
    assert machine_overrides(["+experiment=digits_cpu", "precision.dtype=bf16"]) == []
    assert machine_overrides(["+experiment=digits_cpu", "device=cuda"]) == []  # not on this CPU
    assert not precision.Precision(PrecisionConfig(dtype="fp32"), torch.device("cpu")).emulated_bf16
    assert precision.Precision(PrecisionConfig(dtype="bf16"), torch.device("cpu")).emulated_bf16
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    assert machine_overrides(["+experiment=digits_cpu"]) == []
    assert not precision.Precision(PrecisionConfig(dtype="bf16"), torch.device("cpu")).emulated_bf16
