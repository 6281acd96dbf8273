"""A strategy is one module and one YAML preset: added so, everything that reads strategies finds it.

The toy sparsifier, docs/extending.md's worked example as the guide prints it, is written as those
two files into a folder outside the package (and nothing else is edited): its module declares its
algorithm (each step it sends the first ``keep_ratio`` of every gradient, the same elements on every
rank, and keeps the rest in a residual) and a key of its own, ``keep_ratio``. The factory builds it
in a real two-rank gloo world, where its sums are checked against ``torch.distributed.all_reduce``;
config validation accepts it and refuses a bad ``keep_ratio``, naming it; the scaling model prices
it by its declared rule (an unknown rule raises, never priced as dense); the benchmarks list it.
Then: the package's presets are all registered, old labels read as current ones, and no composite
label (one with ``+ , ( @``) is written anywhere in the package or the scripts but ``variants.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradientflow_repro import variants
from gradientflow_repro.comm import knobs, plan, registry

from conftest import REPO, save_failures, spawn_checked


def worked_example() -> tuple[str, str]:
    """The module and the preset of docs/extending.md's worked example, as the guide prints them:
    the test runs what the guide shows."""
    guide = (REPO / "docs" / "extending.md").read_text()
    example = guide[guide.index("### Worked example"):]
    module = example.split("```python\n", 1)[1].split("```", 1)[0]
    preset = example.split("```yaml\n", 1)[1].split("```", 1)[0]
    return module, preset.replace("module: gradientflow_repro.comm.front", "module: toy_front")


def add_toy(folder: Path) -> None:
    """The toy's two files, in ``folder``; the registry reads that folder's presets, the module
    imports from it."""
    module, preset = worked_example()
    assert "module: toy_front" in preset
    (folder / "toy_front.py").write_text(module)
    (folder / "front.yaml").write_text(preset)


@pytest.fixture
def toy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "toy"
    folder.mkdir()
    add_toy(folder)
    monkeypatch.setenv(registry.PRESET_PATH_VARIABLE, str(folder))
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    sys.modules.pop("toy_front", None)


def _toy_rank(rank: int, world: int, out: str, folder: str) -> None:
    """One rank: the toy found through its two files, built by the factory, one step whose sent
    elements must be ``dist.all_reduce``'s mean and whose other elements wait in the residual."""
    import os

    os.environ[registry.PRESET_PATH_VARIABLE] = folder
    sys.path.insert(0, folder)
    from gradientflow_repro.comm import build_communicator

    failures = []
    comm = build_communicator({"strategy": "front"}, torch.device("cpu"))
    if type(comm).__name__ != "Front":
        failures.append(f"the factory built {type(comm).__name__}")
    torch.manual_seed(0)
    model = nn.Linear(7, 3)
    module = comm.attach(model)
    comm.begin_step(0.0)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    module(x).square().sum().backward()
    own = [p.grad.clone() for p in model.parameters()]
    comm.synchronize()
    comm.end_step(applied=True)
    for param, mine in zip(model.parameters(), own):
        reference = mine.clone()
        dist.all_reduce(reference)
        sent = -(-param.numel() // 4)  # keep_ratio 0.25 of the preset
        if not torch.allclose(param.grad.view(-1)[:sent], reference.view(-1)[:sent] / world, atol=1e-6):
            failures.append("the sent elements are not all_reduce's mean")
        if param.grad.view(-1)[sent:].abs().sum() != 0:
            failures.append("elements beyond keep_ratio were applied")
        if not torch.equal(comm.residual[param][sent:], mine.view(-1)[sent:]):
            failures.append("the unsent elements are not in the residual")
    comm.close()
    save_failures(failures, out, rank)


def test_a_strategy_of_two_files_is_built_by_the_factory_in_a_gloo_world(toy: Path, tmp_path: Path) -> None:
    spawn_checked(_toy_rank, 2, tmp_path, str(toy))


def test_a_strategy_of_two_files_is_validated_with_its_own_key(toy: Path, digits_root: Path) -> None:
    from gradientflow_repro.config import ConfigError, compose, validate

    resolved = plan.resolve({"strategy": "front"})
    assert resolved.keys.keep_ratio == 0.25 and resolved.sends_sparse
    assert plan.resolve({"strategy": "front", "keep_ratio": 0.5}).keys.keep_ratio == 0.5
    with pytest.raises(ValueError, match=r"config key 'comm.keep_ratio' = 1.5: must be in \(0, 1\]"):
        plan.resolve({"strategy": "front", "keep_ratio": 1.5})
    with pytest.raises(ValueError, match="'comm.keep_ratios': no such key"):
        plan.resolve({"strategy": "front", "keep_ratios": 0.5})
    from omegaconf import open_dict

    cfg = compose([f"data.root={digits_root}"])
    with open_dict(cfg):  # what Hydra composes from comm=front where front.yaml is on its search path
        cfg.comm.update(registry.preset("front"), strategy="front")
    validate(cfg, world_size=1)
    cfg.comm.keep_ratio = 0.0
    with pytest.raises(ConfigError, match="'comm.keep_ratio' = 0.0"):
        validate(cfg, world_size=1)


def test_a_strategy_of_two_files_is_priced_by_its_rule_and_an_unknown_rule_raises(
        toy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientflow_repro.scaling import perfmodel as pm

    priced = pm.strategy_of("front")
    assert (priced.density, priced.chunk_elements, priced.wire_bytes) == (0.25, 256, 4)
    assert not priced.takes_optimizer and not priced.noise_sketch  # not CSC's rule
    profile = pm.uniform_profile([5000, 50, 3000, 30], forward_s=0.01, backward_s=0.02)
    net = pm.Network(1e8, 1e-4)
    sparse = pm.predict_step(profile, 4, net, priced).bytes_per_rank
    dense = pm.predict_step(profile, 4, net, dataclasses.replace(priced, density=1.0)).bytes_per_rank
    assert sparse < 0.5 * dense, (sparse, dense)

    module = sys.modules["toy_front"]
    declared = module.SPARSIFIER
    monkeypatch.setattr(module, "SPARSIFIER", dataclasses.replace(declared, pricing="magic"))
    with pytest.raises(ValueError, match="pricing rule 'magic'"):
        pm.strategy_of("front")
    monkeypatch.setattr(module, "SPARSIFIER", dataclasses.replace(declared, priced_as=None))
    with pytest.raises(ValueError, match="needs its parameter 'density'"):  # chunks, but no density given
        pm.strategy_of("front")


def test_a_strategy_of_two_files_is_listed_by_the_benchmarks(toy: Path) -> None:
    from gradientflow_repro.bench import lineup as bench_lineup
    from gradientflow_repro.reproduction import lineup as reproduction_lineup

    assert "front" in bench_lineup.cluster_bench() and "front" in bench_lineup.comm_bench()
    assert variants.options("front") == {"strategy": "front"}
    assert "front" not in reproduction_lineup.LADDER  # a list that names its rungs
    from gradientflow_repro.reproduction.runs import compression_label

    run = {"summary": {"strategy": "front"}, "comm": {"strategy": "front"}, "config": {}}
    assert compression_label(run) == "the first 0.25 of each gradient"  # the report says what it sends


def test_the_package_presets_are_all_registered_and_set_every_knob() -> None:
    presets = knobs.presets()
    assert set(presets) == set(registry.names()) >= {"allreduce", "ddp", "ring", "lazy", "csc", "gradientflow"}
    for name, values in presets.items():
        resolved = plan.resolve({"strategy": name})
        own = set(resolved.sparsifier.key_names())
        assert own <= set(values), f"{name}: the preset leaves keys of its sparsifier unset: {own - set(values)}"
    with pytest.raises(ValueError, match="'comm.strategy' = 'front'"):  # not in the package's folders
        plan.resolve({"strategy": "front"})
    with pytest.raises(ValueError, match="'comm.sparsity' = 'front'"):
        plan.resolve({"strategy": "ring", "sparsity": "front"})
    with pytest.raises(ValueError, match="works over our memory pool"):  # CSC's own rule
        plan.resolve({"strategy": "csc", "fusion": "per_tensor"})


def test_old_labels_read_as_their_current_ones() -> None:
    for old, new in variants.ALIASES.items():
        assert new in variants.variants() and old not in variants.variants()
        assert variants.options(old) == variants.options(new)
    from gradientflow_repro.scaling import projection

    flat = next(old for old, new in variants.ALIASES.items() if new == variants.FLAT)
    assert projection.Setup().strategy(flat) == projection.Setup().strategy(variants.FLAT)


# ------------------------------------------------------------------ labels are written only in variants.py
def composite_labels() -> set[str]:
    """Labels (and old ones) that cannot be mistaken for a word: with ``+ , ( @``."""
    return {label for label in [*variants.variants(), *variants.ALIASES] if any(c in label for c in "+,(@")}


LABELS_MODULE = Path("gradientflow_repro/variants.py")


def labels_written_outside_the_registry(root: Path, labels: set[str]) -> list[str]:
    """``file:line: literal`` for every string literal equal to one of ``labels``, and every dict
    literal keyed by one, in the .py files of ``root``'s gradientflow_repro/ and scripts/ except
    ``variants.py``."""
    found = []
    for folder in ("gradientflow_repro", "scripts"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root) == LABELS_MODULE:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
                if isinstance(node, ast.Dict):
                    keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and k.value in labels]
                    found += [f"{where}: a dict keyed by {key!r}" for key in keys]
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in labels:
                    found.append(f"{where}: {node.value!r}")
    return found


def test_no_strategy_label_is_defined_outside_the_registry() -> None:
    labels = composite_labels()
    assert {variants.RING_FP16, variants.LAZY_FP16, variants.FLAT, "gradientflow@0.01"} <= labels
    assert labels_written_outside_the_registry(REPO, labels) == []


def test_the_label_scan_finds_a_label_written_by_hand(tmp_path: Path) -> None:
    (tmp_path / LABELS_MODULE).parent.mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / LABELS_MODULE).write_text('LABEL = "ring+fp16"\n')  # allowed
    (tmp_path / "gradientflow_repro" / "bench.py").write_text(
        'OPTIONS = {"ring+fp16": {"strategy": "ring", "wire": "fp16"}}\n')
    (tmp_path / "scripts" / "tool.py").write_text('def f(table):\n    return table.get("gradientflow (flat)")\n')
    found = labels_written_outside_the_registry(tmp_path, composite_labels())
    assert found == ["gradientflow_repro/bench.py:1: a dict keyed by 'ring+fp16'",
                     "gradientflow_repro/bench.py:1: 'ring+fp16'", "scripts/tool.py:2: 'gradientflow (flat)'"], found
