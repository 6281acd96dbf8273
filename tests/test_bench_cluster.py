"""The communication-only cluster benchmark (``harness.bench_cluster``): the replay releases every
gradient in the order asked, and a short run on loopback writes complete rows and tables."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gradientflow_repro.harness import bench_cluster


def test_the_replay_releases_each_gradient_in_the_given_order_with_its_value() -> None:
    spec = bench_cluster.model_spec("digits_cpu")
    real = bench_cluster.backward_order(spec)
    model = bench_cluster.build(spec)
    params = [p for p in model.parameters() if p.requires_grad]
    assert sorted(real) == list(range(len(params)))
    order = list(torch.randperm(len(params), generator=torch.Generator().manual_seed(0)))
    order = [int(i) for i in order]  # any order, not only backward's
    gradients = [torch.randn(p.shape) for p in params]
    fired: list[int] = []
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(lambda p, i=index: fired.append(i))
    replay = bench_cluster.make_replay(model, order, gradients)
    assert list(replay.parameters()) == list(model.parameters())
    replay().backward()
    assert fired == order
    assert all(torch.equal(p.grad, g) for p, g in zip(params, gradients))


def test_a_short_run_on_loopback_writes_rows_and_tables(tmp_path: Path) -> None:
    md, raw = tmp_path / "cluster_comm.md", tmp_path / "cluster_comm.json"
    text = bench_cluster.bench_cluster(md, raw, layouts=[(2, 1)], labels=["lazy", "ddp"], steps=1, warmup=0,
                                       emulate=False, check=False, runs_dir=tmp_path / "runs", measure="links",
                                       command="pytest")
    facts = json.loads(raw.read_text())
    assert facts["emulated"] is False and facts["rate_check"] is None and facts["machine"]["git_commit"] is not None
    assert facts["model"]["name"] == "alexnet_bn" and len(facts["model"]["tensors_in_backward_order"]) == 23
    rows = facts["rows"]
    assert [r["strategy"] for r in rows] == ["lazy", "ddp"], rows
    for row in rows:
        assert row["error"] is None, row["error"]
        assert row["layout"] == "2x1" and row["world"] == 2 and len(row["comm_s_all"]) == 1
        assert row["comm_s_median"] > 0 and row["collectives_per_step"] >= 1
        # the whole model crosses: 2(N-1)/N of 2.25M fp32 values at N = 2
        assert row["bytes_per_step"] >= 4 * facts["model"]["parameters"]
    network = facts["layouts"][0]["network"]
    assert network["leaders"]["bandwidth_Bps"] > 0 and network["model_network"]["ranks_per_node"] == 1
    # CSC's and the fp16 wire's local work, timed on every rank at once in the launch
    assert set(network["local_work_in_step"]) == {"sparsify_s_per_element", "wire_cast_s_per_element"}
    assert all(0 < seconds < 1e-6 for seconds in network["local_work_in_step"].values())
    assert "loopback, not emulated" in text and "| lazy |" in text and "| ddp |" in text and "failed" not in text
    assert md.read_text() == text
