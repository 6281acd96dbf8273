"""Hierarchical allreduce: reduce inside each node, ring among node leaders, broadcast back.

On a cluster the links inside a node (NVLink, PCIe) are far faster than those between nodes. Only
one rank per node (its leader, the lowest rank) takes part in the inter-node ring, so the slow
network carries 2(M-1)/M of the tensor for M nodes instead of for N = M * G ranks, and each message
is G times larger, which amortises per-message latency. Nodes are consecutive blocks of
``ranks_per_node`` global ranks (torchrun and Slurm number ranks node by node; the last block may
hold fewer, as when a job's GPU count is not a multiple of the node size); on one machine any block
size can be chosen, which is how the tests emulate several nodes. The block size comes from the
launcher (torchrun's LOCAL_WORLD_SIZE, Slurm's tasks per node: ``distributed.World``), never
guessed; a layout that is not node by node (Slurm's ``--distribution=cyclic``) is refused.

Where it runs: on gloo (``comm.algorithm=hierarchical``, or ``auto`` on several nodes of several
ranks). On NCCL it runs only under ``comm.implementation=ours``, for comparison: its leaders' ring
sends between nodes through local rank 0's NIC alone (one of a node's NICs), while NCCL's own
allreduce, the default there (``knobs.summing``), is two-level by itself (its tree: a chain inside
the node, a double binary tree between nodes) and lays a channel over every NIC.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from gradientflow_repro.comm.base import CommStats
from gradientflow_repro.comm.ring import DEFAULT_SEGMENT_BYTES, ring_allreduce_


class HierarchicalSum:
    """An in-place SUM over all ranks (a ``SumFn``). Creating it is collective: every rank must
    construct it, in the same order relative to other process groups."""

    def __init__(self, ranks_per_node: int, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 local_rank: Optional[int] = None) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if ranks_per_node < 1:
            raise ValueError(f"config key 'comm.ranks_per_node' = {ranks_per_node}: must be at least 1")
        if local_rank is not None:  # every rank checks every rank's place: all raise, or none
            local_ranks: list = [None] * world
            dist.all_gather_object(local_ranks, local_rank)
            misplaced = [r for r, local in enumerate(local_ranks) if local != r % ranks_per_node]
            if misplaced:
                raise ValueError(f"hierarchical allreduce needs ranks numbered node by node "
                                 f"({ranks_per_node} per node), but rank(s) {misplaced[:8]} are not "
                                 f"where that puts them; launch with srun --distribution=block (or torchrun)")
        self.ranks_per_node, self.segment_bytes = ranks_per_node, segment_bytes
        self.nodes = -(-world // ranks_per_node)  # the last node may be partly filled
        self.leader = rank - rank % ranks_per_node
        self.node_size = min(ranks_per_node, world - self.leader)  # ranks on this rank's node
        self.node_group = self.leader_group = None
        for node in range(self.nodes):  # new_group is collective: every rank creates every group
            members = list(range(node * ranks_per_node, min((node + 1) * ranks_per_node, world)))
            group = dist.new_group(members)
            if rank in members:
                self.node_group = group
        leaders_group = dist.new_group([node * ranks_per_node for node in range(self.nodes)])
        if rank == self.leader:
            self.leader_group = leaders_group
        self.is_leader = rank == self.leader

    def __call__(self, tensor: torch.Tensor, stats: CommStats) -> None:
        payload = tensor.numel() * tensor.element_size()
        if self.node_size > 1:
            dist.reduce(tensor, dst=self.leader, group=self.node_group)
            stats.bytes += 0 if self.is_leader else payload
        if self.is_leader and self.nodes > 1:
            stats.bytes += ring_allreduce_(tensor, self.leader_group, self.segment_bytes)
        if self.node_size > 1:
            dist.broadcast(tensor, src=self.leader, group=self.node_group)
            stats.bytes += payload * (self.node_size - 1) if self.is_leader else 0
        stats.collectives += 1
