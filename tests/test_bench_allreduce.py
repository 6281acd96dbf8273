"""scripts/bench_allreduce.py end to end, on sizes too small to judge the goal (a quick sweep)."""

from __future__ import annotations

import csv
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
