"""Every shipped config composes; every bad value fails with a message naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from gradientflow_repro.config import ConfigError, register_configs, validate

from conftest import CONFIGS, REPO

register_configs()
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
GROUPS = {group: sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))
          for group in ("model", "data", "optim", "comm", "precision", "logger")}


def make(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base=None):
        return compose(config_name="config", overrides=overrides)


def test_shipped_experiments_are_the_promised_ones() -> None:
    assert {"digits_cpu", "alexnet_512gpu", "resnet50_512gpu"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_validates(experiment: str, digits_root: Path) -> None:
    cfg = make([f"+experiment={experiment}", f"data.root={digits_root}"])
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    world = 512 if experiment.endswith("512gpu") else 4
    if cfg.data.kind == "folder" and cfg.data.num_classes != 10:
        cfg.data.num_classes = 10  # validation does not count classes; training does
    validate(cfg, world_size=world)
    assert cfg.experiment == experiment


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group: str, option: str, digits_root: Path) -> None:
    cfg = make([f"{group}={option}", f"data.root={digits_root}"])
    validate(cfg, world_size=1)


def test_paper_scale_experiments_carry_the_paper_settings() -> None:
    cfg = make(["+experiment=alexnet_512gpu"])
    assert (cfg.global_batch_size, cfg.epochs, cfg.precision.dtype) == (65536, 95, "fp16")
    assert cfg.global_batch_size % 512 == 0 and cfg.optim.name == "lars"


BAD = [
    (["model.name=vgg"], "model.name", "alexnet_bn, alexnet, resnet50"),
    (["comm.strategy=carrier_pigeon"], "comm.strategy", "allreduce"),
    (["optim.base_lr=0"], "optim.base_lr", "must be positive"),
    (["optim.base_lr=-1.5"], "optim.base_lr", "must be positive"),
    (["global_batch_size=0"], "global_batch_size", "must be positive"),
    (["global_batch_size=130"], "global_batch_size", "divisible by the world size 4"),
    (["precision.dtype=fp8"], "precision.dtype", "fp32, bf16, fp16"),
    (["data.loader=pil"], "data.loader", "dali, torchvision"),
    (["data.root=/nonexistent/imagenet"], "data.root", "does not exist"),
    (["comm=gradientflow-paper", "optim.name=apex_larc"], "optim.name", "comm.momentum_correction=false"),
]


@pytest.mark.parametrize("overrides,key,allowed", BAD, ids=[b[1] + ":" + b[0][0] for b in BAD])
def test_bad_config_names_the_key(overrides: list[str], key: str, allowed: str, digits_root: Path) -> None:
    cfg = make(["+experiment=digits_cpu", f"data.root={digits_root}", *overrides])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=4)
    assert f"'{key}'" in str(error.value) and allowed in str(error.value)


def test_data_root_without_class_folders(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "val").mkdir()
    cfg = make(["+experiment=digits_cpu", f"data.root={tmp_path}"])
    with pytest.raises(ConfigError, match="'data.root'.*no class folders"):
        validate(cfg, world_size=4)


def test_misspelt_key_is_rejected_by_the_schema() -> None:
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="learning_rate"):
        make(["optim.learning_rate=3"])


def test_cli_fails_before_any_process_group(tmp_path: Path) -> None:
    """A bad value ends the entry point at once with exit code 2 and the key in the message; no
    process group is started (WORLD_SIZE=4 with no peers would otherwise wait for them)."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "gradientflow_repro.train", "+experiment=digits_cpu",
                             "global_batch_size=130", f"run_dir={tmp_path}"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "global_batch_size" in result.stderr and "divisible by the world size 4" in result.stderr


# ---------------------------------------------------------------- declared next to each field
MORE_BAD = [
    ("optim.momentum=1.5", "optim.momentum", "must be in [0, 1)"),
    ("optim.weight_decay=-0.1", "optim.weight_decay", "must be zero or positive"),
    ("comm.csc_warmup_epochs=-1", "comm.csc_warmup_epochs", "must be zero or positive"),
    ("comm=csc comm.density=1.5", "comm.density", "must be in (0, 1]"),  # CSC's own keys (csc.CSCKeys)
    ("comm=gradientflow comm.release_cap=inf", "comm.release_cap", "must be in [0, inf)"),
    ("model.dropout=1", "model.dropout", "must be in [0, 1)"),
    ("data.std=[1,0,1]", "data.std", "must be 3 numbers"),
    ("precision.init_scale=0", "precision.init_scale", "must be positive"),
    ("seed=-3", "seed", "must be zero or positive"),
    ("comm.wire=fp8", "comm.wire", "allowed values are fp32, fp16"),
]


@pytest.mark.parametrize("override,key,allowed", MORE_BAD, ids=[b[1] for b in MORE_BAD])
def test_every_field_checks_its_own_range(override: str, key: str, allowed: str, digits_root: Path) -> None:
    cfg = make(["+experiment=digits_cpu", f"data.root={digits_root}", *override.split()])
    with pytest.raises(ConfigError) as error:
        validate(cfg, world_size=4)
    assert f"'{key}'" in str(error.value) and allowed in str(error.value), str(error.value)


def test_every_field_declares_what_it_allows() -> None:
    import dataclasses

    from gradientflow_repro.config import Config

    def undeclared(schema: type, prefix: str = "") -> list[str]:
        missing = []
        for spec in dataclasses.fields(schema):
            if dataclasses.is_dataclass(spec.default_factory):
                missing += undeclared(spec.default_factory, prefix + spec.name + ".")
            elif "check" not in spec.metadata:
                missing.append(prefix + spec.name)
        return missing

    assert undeclared(Config) == []


# ---------------------------------------------------------------- one definition of a strategy
def test_presets_are_the_yaml_and_show_every_knob() -> None:
    from gradientflow_repro.comm.knobs import KNOB_VALUES, presets
    from gradientflow_repro.comm.plan import resolve
    from gradientflow_repro.reproduction.lineup import LADDER

    assert set(presets()) == set(GROUPS["comm"])
    for name, knobs in presets().items():
        assert set(KNOB_VALUES) <= set(knobs), name  # a reader of the YAML sees every knob
        resolved = resolve({"strategy": name})
        assert all(getattr(resolved, knob) == knobs[knob] for knob in KNOB_VALUES)
    full = resolve({"strategy": "gradientflow"})
    knobs = (full.algorithm, full.wire, full.fusion, full.overlap, full.sparsity)
    assert knobs == ("auto", "fp16", "lazy", True, "csc")  # auto: two-level on several multi-rank nodes
    assert full.keys.release_cap == resolve({"strategy": "csc"}).keys.release_cap == 3  # the presets cap releases
    # DGC's rule, one override away
    assert resolve({"strategy": "gradientflow", "release_cap": 0}).keys.release_cap == 0
    for label, options in LADDER.items():  # every rung composes through Hydra to the same knobs
        from gradientflow_repro.comm.knobs import hydra_overrides

        cfg = make(hydra_overrides(options))
        assert resolve(cfg.comm) == resolve(options), label


def test_the_strategy_definitions_and_the_config_check_need_no_torch() -> None:
    code = ("import sys; import gradientflow_repro.config, gradientflow_repro.comm.plan; "
            "from gradientflow_repro.comm.plan import resolve; resolve({'strategy': 'gradientflow'}); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
