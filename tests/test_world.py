"""World discovery from torchrun's and Slurm's environments."""

from __future__ import annotations

import pytest

from gradientflow_repro.distributed import WorldError, discover_world, first_slurm_host


def test_torchrun_environment() -> None:
    world = discover_world({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                            "MASTER_ADDR": "node7", "MASTER_PORT": "29555"})
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (5, 8, 1, 4)
    assert (world.master_addr, world.master_port, world.source) == ("node7", 29555, "torchrun")


def test_slurm_environment_without_torchrun() -> None:
    world = discover_world({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                            "SLURM_NTASKS_PER_NODE": "8(x2)",
                            "SLURM_JOB_NODELIST": "gpu[017-018]"})
    assert (world.rank, world.world_size, world.local_rank, world.local_world_size) == (9, 16, 1, 8)
    assert world.source == "slurm" and world.master_addr.startswith("gpu017")


def test_single_process_by_default() -> None:
    world = discover_world({})
    assert (world.rank, world.world_size, world.source) == (0, 1, "single")


def test_torchrun_inconsistent_with_slurm_is_refused() -> None:
    with pytest.raises(WorldError, match="SLURM_NTASKS=16"):
        discover_world({"RANK": "0", "WORLD_SIZE": "8", "SLURM_NTASKS": "16", "SLURM_NNODES": "2",
                        "SLURM_STEP_ID": "0"})


def test_rank_outside_world() -> None:
    with pytest.raises(WorldError, match="rank 4 is outside world size 4"):
        discover_world({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.parametrize("nodelist,first", [("node1", "node1"), ("gpu[003-010,017]", "gpu003"),
                                            ("a[7,9]", "a7")])
def test_first_host_of_a_node_list(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first
