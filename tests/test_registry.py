"""The strategy registry is the one place that names, labels and lists strategies.

A toy strategy that brings its own sparsifier is added through the registry alone (``register``,
its preset given in its entry), and everything that reads strategies finds it: the factory builds
it in a real two-rank gloo world, the scaling model prices it by its declared rule (not as dense;
an unknown rule raises), the benchmarks list it, config validation accepts it (and refuses it
unregistered). Then: no composite label (one with ``+ , ( @``) is written anywhere in the package
or the scripts but the registry.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from gradientflow_repro.comm import knobs, registry
from gradientflow_repro.comm.lazy import LazyAllreduce

from conftest import REPO, save_failures, spawn_checked


class ToyCommunicator(LazyAllreduce):
    """The toy sparsifier's communicator: the lazy pool as it is (a stand-in; what is checked here is
    that the factory reaches it through the registry, not an algorithm)."""


def toy_communicator(cfg: knobs.CommConfig, device: torch.device, sum_fn, lr_warmup_epochs: float) -> ToyCommunicator:
    return ToyCommunicator(device, sum_fn, int(cfg.bucket_mb * 2**20), cfg.overlap)


TOY_FP16 = "toy+fp16"
TOY = registry.Entry(
    "toy", "a toy sparsifier over the pool, priced as whole chunks at its density",
    (registry.Variant("toy", {}, (registry.COMM_BENCH,)),
     registry.Variant(TOY_FP16, {"wire": "fp16"},
                      (registry.CLUSTER_BENCH, registry.COMM_BENCH, registry.GPU_CHECK, registry.PROJECTION))),
    preset={"algorithm": "ring", "wire": "fp32", "fusion": "lazy", "overlap": False, "sparsity": "toy_chunks",
            "bucket_mb": 0.004, "chunk_size": 100, "density": 0.25},
    sparsifier=registry.Sparsifier("toy_chunks", pricing="chunks", builder=toy_communicator, needs_pool=True))


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> registry.Entry:
    """The toy registered for one test (the registry's tables restored after it)."""
    monkeypatch.setattr(registry, "STRATEGIES", dict(registry.STRATEGIES))
    monkeypatch.setattr(registry, "SPARSIFIERS", dict(registry.SPARSIFIERS))
    registry.register(TOY)
    return TOY


def _toy_rank(rank: int, world: int, out: str) -> None:
    """One rank of the toy strategy: registered in this process, built by the factory, one step whose
    gradients must be the mean of every rank's."""
    from gradientflow_repro.comm import build_communicator

    if "toy" not in registry.STRATEGIES:  # a fresh process: the registry as the package ships it
        registry.register(TOY)
    failures = []
    comm = build_communicator({"strategy": "toy"}, torch.device("cpu"))
    if not isinstance(comm, ToyCommunicator):
        failures.append(f"the factory built {type(comm).__name__}")
    torch.manual_seed(0)
    model = nn.Linear(7, 3)
    module = comm.attach(model)
    comm.begin_step(0.0)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    module(x).square().sum().backward()
    comm.synchronize()
    comm.end_step(applied=True)
    mine = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    local = []
    for other in range(world):  # every rank's own gradient, recomputed here
        copy = nn.Linear(7, 3)
        copy.load_state_dict({k: v for k, v in zip(("weight", "bias"), model.parameters())})
        xo = torch.randn(4, 7, generator=torch.Generator().manual_seed(other))
        copy(xo).square().sum().backward()
        local.append(torch.cat([p.grad.reshape(-1) for p in copy.parameters()]))
    if not torch.allclose(mine, torch.stack(local).mean(0), atol=1e-5):
        failures.append("the step's gradients are not the mean of the ranks' own")
    comm.close()
    save_failures(failures, out, rank)


def test_a_registered_strategy_is_built_by_the_factory_in_a_gloo_world(tmp_path: Path) -> None:
    spawn_checked(_toy_rank, 2, tmp_path)


def test_a_registered_sparsifier_is_priced_by_its_rule_and_an_unknown_rule_raises(
        toy: registry.Entry, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradientflow_repro.scaling import perfmodel as pm

    priced = pm.strategy_of(TOY_FP16)
    assert (priced.density, priced.chunk_elements, priced.wire_bytes) == (0.25, 100, 2)
    assert not priced.takes_optimizer and not priced.noise_sketch  # no momentum correction: not CSC's rule
    profile = pm.uniform_profile([5000, 50, 3000, 30], forward_s=0.01, backward_s=0.02)
    net = pm.Network(1e8, 1e-4)
    sparse = pm.predict_step(profile, 4, net, priced).bytes_per_rank
    dense = pm.predict_step(profile, 4, net, dataclasses.replace(priced, density=1.0)).bytes_per_rank
    assert sparse < 0.5 * dense, (sparse, dense)  # a quarter of the chunks, and the dense 1-D tensors
    assert knobs.sends_sparse(knobs.resolve({"strategy": "toy"}))

    for rule in registry.PRICING_RULES:  # every rule the registry lets in, the model prices
        monkeypatch.setitem(registry.SPARSIFIERS, "toy_chunks", dataclasses.replace(toy.sparsifier, pricing=rule))
        pm.strategy_of(TOY_FP16)
    monkeypatch.setitem(registry.SPARSIFIERS, "toy_chunks", dataclasses.replace(toy.sparsifier, pricing="magic"))
    with pytest.raises(ValueError, match="pricing rule 'magic'"):
        pm.strategy_of(TOY_FP16)
    with pytest.raises(ValueError, match="no pricing rule"):  # and the registry refuses it first
        registry.register(dataclasses.replace(toy, name="toy2", variants=(), sparsifier=dataclasses.replace(
            toy.sparsifier, name="toy2_chunks", pricing="magic")))


def test_a_registered_strategy_is_in_the_lists_and_the_benchmarks(toy: registry.Entry) -> None:
    from gradientflow_repro.bench import cluster, comm
    from gradientflow_repro.scaling import projection

    assert TOY_FP16 in cluster.strategy_labels()
    assert cluster.strategy_options(TOY_FP16, 2) == {"strategy": "toy", "wire": "fp16"}
    assert ("toy", {"strategy": "toy"}) in comm.configs() and (TOY_FP16, {"strategy": "toy", "wire": "fp16"}) \
        in comm.configs()
    assert TOY_FP16 in registry.labels(registry.GPU_CHECK)
    assert TOY_FP16 in projection.default_strategies() and TOY_FP16 in projection.Setup().strategies
    assert projection.Setup().strategy(TOY_FP16).density == 0.25
    assert TOY_FP16 not in knobs.LADDER  # a list it did not ask for


def test_config_validation_accepts_exactly_the_registered_strategies(monkeypatch: pytest.MonkeyPatch,
                                                                    digits_root: Path) -> None:
    from gradientflow_repro.config import ConfigError, compose, validate

    assert registry.unregistered_presets() == []  # every YAML of configs/comm/ is registered ...
    assert set(knobs.presets()) == set(registry.names())  # ... and every entry has its preset
    for name in registry.names():
        knobs.resolve({"strategy": name})

    cfg = compose([f"data.root={digits_root}"])
    cfg.comm.strategy = "toy"
    for knob in knobs.KNOB_VALUES:  # the preset's knobs, not allreduce's that Hydra composed
        cfg.comm[knob] = None
    with pytest.raises(ConfigError, match="'comm.strategy' = 'toy'"):
        validate(cfg, world_size=1)
    with pytest.raises(ValueError, match="'comm.sparsity' = 'toy_chunks'"):
        knobs.resolve({"strategy": "ring", "sparsity": "toy_chunks"})

    monkeypatch.setattr(registry, "STRATEGIES", dict(registry.STRATEGIES))
    monkeypatch.setattr(registry, "SPARSIFIERS", dict(registry.SPARSIFIERS))
    registry.register(TOY)
    validate(cfg, world_size=1)
    assert knobs.resolve(cfg.comm).sparsity == "toy_chunks"
    with pytest.raises(ValueError, match="works over our memory pool"):  # the sparsifier's own rule
        knobs.resolve({"strategy": "toy", "fusion": "per_tensor"})
    with pytest.raises(ValueError, match="registered already"):
        registry.register(TOY)


def test_old_labels_read_as_their_current_ones() -> None:
    for old, new in registry.ALIASES.items():
        assert new in registry.variants() and old not in registry.variants()
        assert registry.options(old) == registry.options(new)
    from gradientflow_repro.scaling import projection

    flat = next(old for old, new in registry.ALIASES.items() if new == registry.FLAT)
    assert projection.Setup().strategy(flat) == projection.Setup().strategy(registry.FLAT)


# ------------------------------------------------------------------ labels are written only in the registry
def composite_labels() -> set[str]:
    """Registered labels (and old ones) that cannot be mistaken for a word: with ``+ , ( @``."""
    return {label for label in [*registry.variants(), *registry.ALIASES] if any(c in label for c in "+,(@")}


def labels_written_outside_the_registry(root: Path, labels: set[str]) -> list[str]:
    """``file:line: literal`` for every string literal equal to one of ``labels``, and every dict
    literal keyed by one, in the .py files of ``root``'s gradientflow_repro/ and scripts/ except the
    registry module."""
    found = []
    for folder in ("gradientflow_repro", "scripts"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root) == Path("gradientflow_repro/comm/registry.py"):
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
    assert {registry.RING_FP16, registry.LAZY_FP16, registry.FLAT, "gradientflow@0.01"} <= labels
    assert labels_written_outside_the_registry(REPO, labels) == []


def test_the_label_scan_finds_a_label_written_by_hand(tmp_path: Path) -> None:
    (tmp_path / "gradientflow_repro" / "comm").mkdir(parents=True)
    (tmp_path / "scripts").mkdir()
    (tmp_path / "gradientflow_repro" / "comm" / "registry.py").write_text('LABEL = "ring+fp16"\n')  # allowed
    (tmp_path / "gradientflow_repro" / "bench.py").write_text(
        'OPTIONS = {"ring+fp16": {"strategy": "ring", "wire": "fp16"}}\n')
    (tmp_path / "scripts" / "tool.py").write_text('def f(table):\n    return table.get("gradientflow (flat)")\n')
    found = labels_written_outside_the_registry(tmp_path, composite_labels())
    assert found == ["gradientflow_repro/bench.py:1: a dict keyed by 'ring+fp16'",
                     "gradientflow_repro/bench.py:1: 'ring+fp16'", "scripts/tool.py:2: 'gradientflow (flat)'"], found
