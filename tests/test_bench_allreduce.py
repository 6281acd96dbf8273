"""scripts/bench_allreduce.py end to end, on sizes too small to judge the goal (a quick sweep)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def test_small_sweep_writes_both_tables_and_says_the_goal_was_not_judged(tmp_path: Path) -> None:
    out = tmp_path / "allreduce"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_allreduce.py"), "--worlds", "2",
                           "--max-mb", "1", "--repeats", "1", "--budget-s", "0.02", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out.with_suffix(".csv")) as handle:
        rows = list(csv.DictReader(handle))
    sizes = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    assert sorted({(int(r["bytes"]), r["algorithm"]) for r in rows}) == sorted(
        (size, name) for size in sizes for name in ("builtin", "hierarchical", "ring"))
    for row in rows:  # nccl-tests' bus bandwidth, from the same row's time
        world, size, seconds = int(row["world"]), int(row["bytes"]), float(row["seconds"])
        assert float(row["busbw_GBps"]) == pytest.approx(size / seconds * 2 * (world - 1) / world / 1e9)
        assert float(row["vs_builtin"]) > 0
    table = out.with_suffix(".md").read_text()
    assert "## World size 2" in table and "| 1 MiB |" in table
    assert "not judged, no size from 4 MiB up was timed" in table
    assert "Command: `python scripts/bench_allreduce.py --worlds 2 --max-mb 1" in table


def test_the_goal_is_a_value_decided_on_the_medians_from_4_mib_up() -> None:
    from gradientflow_repro import render
    from gradientflow_repro.bench.allreduce import goal

    def size(nbytes: int, ratios: list[float]) -> dict:
        return {"bytes": nbytes, "vs_builtin": {"ring": ratios}}

    small = [size(1 << 20, [0.1, 0.1, 0.1])]  # below 4 MiB: not judged
    assert goal(small)["judged"] is False and goal(small)["met"] is None
    judged = goal(small + [size(4 << 20, [0.95, 0.85, 0.92]), size(16 << 20, [0.91, 0.99, 0.93])])
    assert judged["met"] is True and judged["worst_median"] == 0.92 and judged["lowest"] == 0.85
    assert judged["lowest_bytes"] == 4 << 20
    missed = goal([size(4 << 20, [0.95, 0.95, 0.95]), size(16 << 20, [0.89, 0.95, 0.80])])
    assert missed["met"] is False and missed["worst_bytes"] == 16 << 20
    # the committed table is rendered from its data, the verdict worded from the value
    document = json.loads((REPO / "results" / "allreduce.json").read_text())
    assert [world["goal"]["met"] for world in document["worlds"]] == [False, False]
    assert render.render(document) == (REPO / "results" / "allreduce.md").read_text()
