"""The emulated cluster of ``cluster.netemu`` with nodes of several ranks: ranks of one node share a
namespace and talk over loopback (unshaped), nodes talk through one shaped uplink each, the ranks
are told their place in the node, and nothing is left behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gradientflow_repro.cluster import netemu, preloaded
from gradientflow_repro.cluster.launch import network, run_ranks

from support import needs_netemu

# Each rank: its node's namespace, its local rank, the address gloo bound to; then rank 0 times an
# 8 MiB send (and a one-element reply) to rank 1 (its own node) and to rank 2 (the other node).
PROBE = """
import json, os, time
import torch, torch.distributed as dist
from gradientflow_repro.cluster.world import run_rank

def probe(rank, world):
    seen = [None] * world
    dist.all_gather_object(seen, [os.readlink('/proc/self/ns/net'), os.environ['LOCAL_RANK'],
                                  os.environ['LOCAL_WORLD_SIZE']])
    payload, ack = torch.ones(2 * 2**20), torch.zeros(1)
    seconds = {}
    for peer in (1, 2):
        for _ in range(2):  # the first exchange warms up, the second is timed
            dist.barrier()
            if rank == 0:
                started = time.perf_counter()
                dist.send(payload, peer)
                dist.recv(ack, peer)
                seconds[peer] = time.perf_counter() - started
            elif rank == peer:
                dist.recv(payload, 0)
                dist.send(ack, 0)
    if rank == 0:
        print('[probe] ' + json.dumps({'seen': seen, 'intra_s': seconds[1], 'inter_s': seconds[2],
                                       'bytes': payload.numel() * 4}), flush=True)

run_rank(probe, int(os.environ['RANK']), int(os.environ['WORLD_SIZE']), 'env://', timeout_s=60)
"""


@pytest.mark.parametrize("started", ["interpreter", "forked"])
def test_two_nodes_of_two_ranks_share_a_shaped_uplink_and_talk_inside_unshaped(
        started: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank a fresh interpreter (``-c``), or forked from the rank server into its node's
    namespace (``-m``, ``cluster.preloaded``), as training ranks are."""
    module: tuple[str, ...] = ("-c", PROBE)
    if started == "forked":
        (tmp_path / "netemu_probe.py").write_text(PROBE)
        monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])  # the ranks' sys.path is ours
        module = ("-m", "netemu_probe")
    needs_netemu()
    before = set(netemu.namespaces())
    with network(4, 100, None, ranks_per_node=2) as net:
        assert net is not None and net.nodes == 2
        assert set(netemu.namespaces(net.prefix)) == {f"{net.prefix}sw", f"{net.prefix}n0", f"{net.prefix}n1"}
        assert [net.address(r) for r in range(4)] == ["10.77.0.1", "10.77.0.1", "10.77.0.2", "10.77.0.2"]
        assert net.namespace(1) == net.namespace(0) != net.namespace(2) == net.namespace(3)
        run_ranks(4, [], tmp_path, "probe", net, timeout_s=120, show=False, module=module)
        assert all(isinstance(p, preloaded.ForkedRank) == (started == "forked") for p in net.processes)
        line = next(line for line in (tmp_path / "rank0.log").read_text().splitlines() if line.startswith("[probe]"))
        result = json.loads(line[len("[probe] "):])
        payload_Bps = net.payload_Bps
        pids = [p.pid for p in net.processes]
    namespaces, local_ranks = [s[0] for s in result["seen"]], [s[1:] for s in result["seen"]]
    assert namespaces[0] == namespaces[1] != namespaces[2] == namespaces[3], namespaces
    assert local_ranks == [["0", "2"], ["1", "2"], ["0", "2"], ["1", "2"]], local_ranks
    inter_Bps, intra_Bps = result["bytes"] / result["inter_s"], result["bytes"] / result["intra_s"]
    # between nodes: the uplink's rate (tbf's 256 kB burst lets a little more through at first)
    assert 0.75 * payload_Bps < inter_Bps < 1.25 * payload_Bps, (inter_Bps, payload_Bps)
    # inside a node: loopback, far beyond what the shaped uplink would let through
    assert intra_Bps > 5 * payload_Bps, (intra_Bps, payload_Bps)
    assert set(netemu.namespaces()) == before, "namespaces left behind"
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_one_rank_per_node_keeps_the_launcher_s_local_ranks() -> None:
    net = netemu.EmulatedNetwork(3, rate_mbit=None)
    assert net.nodes == 3 and [net.namespace(r) for r in range(3)] == [f"{net.prefix}n{r}" for r in range(3)]
    assert [net.address(r) for r in range(3)] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    with pytest.raises(ValueError, match="must divide"):
        netemu.EmulatedNetwork(4, rate_mbit=None, ranks_per_node=3)
