"""LARS (timm's Lars with our parameter groups) and the warm-up / polynomial schedule."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from gradientflow_repro.config import OptimConfig
from gradientflow_repro.models import AlexNetBN
from gradientflow_repro.optim import WarmupPolySchedule, build_optimizer, build_schedule, parameter_groups, peak_lr


def test_bn_and_bias_are_excluded_from_decay_and_adaptation() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    adapted, plain = parameter_groups(model, weight_decay=1e-4)
    assert [p.shape for p in adapted["params"]] == [torch.Size([3, 4])]
    assert {tuple(p.shape) for p in plain["params"]} == {(3,)} and len(plain["params"]) == 3
    assert adapted["weight_decay"] == 1e-4 and plain["weight_decay"] == 0.0


def test_one_lars_step_matches_hand_computation() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    cfg = OptimConfig(base_lr=0.8, base_batch_size=256, momentum=0.9, weight_decay=0.01,
                      trust_coeff=0.02)
    optimizer = build_optimizer(model, cfg, global_batch=512)
    lr = 0.8 * 512 / 256
    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    model(torch.randn(7, 5)).pow(2).sum().backward()
    g_w, g_b = model.weight.grad.clone(), model.bias.grad.clone()
    optimizer.step()
    # weight: trust ratio eta*|w| / (|g| + wd*|w|), applied to (g + wd*w); first momentum step = the update
    trust = 0.02 * weight.norm() / (g_w.norm() + 0.01 * weight.norm())
    expected_w = weight - lr * trust * (g_w + 0.01 * weight)
    # bias: no weight decay, no adaptation: plain SGD
    expected_b = bias - lr * g_b
    torch.testing.assert_close(model.weight.detach(), expected_w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.bias.detach(), expected_b, rtol=1e-6, atol=1e-7)


def test_clone_reloaded_from_state_dict_steps_in_lockstep() -> None:
    torch.manual_seed(1)
    cfg = OptimConfig(base_lr=2.0, trust_coeff=0.01)
    model = AlexNetBN(num_classes=10, image_size=32, width=0.125, dropout=0.0)
    optimizer = build_optimizer(model, cfg, global_batch=64)
    data = [(torch.randn(8, 3, 32, 32), torch.randint(10, (8,))) for _ in range(6)]

    def step(m: nn.Module, opt: torch.optim.Optimizer, batch) -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(m(batch[0]), batch[1]).backward()
        opt.step()

    for batch in data[:3]:
        step(model, optimizer, batch)
    clone = copy.deepcopy(model)
    clone_optimizer = build_optimizer(clone, cfg, global_batch=64)
    saved = io.BytesIO()  # through bytes, as from a checkpoint: no tensor is shared with the original
    torch.save(optimizer.state_dict(), saved)
    saved.seek(0)
    clone_optimizer.load_state_dict(torch.load(saved, weights_only=True))
    for batch in data[3:]:
        step(model, optimizer, batch)
        step(clone, clone_optimizer, batch)
        for a, b in zip(model.parameters(), clone.parameters()):
            assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(),
                                                      AlexNetBN(10, 32, 0.125).parameters()))


def test_schedule_values_at_chosen_iterations() -> None:
    schedule = WarmupPolySchedule(peak=8.0, warmup_steps=4, total_steps=14, power=2.0, end=0.0)
    assert [schedule(s) for s in range(4)] == [2.0, 4.0, 6.0, 8.0]
    assert schedule(4) == 8.0  # decay starts at the peak
    assert schedule(9) == pytest.approx(8.0 * (1 - 5 / 10) ** 2)  # = 2.0
    assert schedule(13) == pytest.approx(8.0 * (1 - 9 / 10) ** 2)
    assert schedule(14) == 0.0 and schedule(100) == 0.0


def test_schedule_from_config_scales_with_global_batch() -> None:
    cfg = OptimConfig(base_lr=2.0, base_batch_size=256, warmup_epochs=2.5, poly_power=1.0, end_lr=0.5)
    assert peak_lr(cfg, 65536) == 512.0
    schedule = build_schedule(cfg, global_batch=65536, steps_per_epoch=10, epochs=95)
    assert (schedule.warmup_steps, schedule.total_steps) == (25, 950)
    assert schedule(24) == 512.0
    assert schedule(25 + 925 // 2) == pytest.approx((512 - 0.5) * (1 - 462 / 925) + 0.5)


def _fresh_process(probe: str) -> list[str]:
    """The words ``probe`` prints, run by a fresh interpreter (what a rank has imported at start)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_lars_is_timms_own_class_imported_only_where_it_is_used() -> None:
    """Importing the trainer imports no timm (its package pulls in its model zoo and torchvision:
    seconds per process); ``optim.Lars`` is timm's own class, from the very file timm ships."""
    probe = ("import importlib.util, inspect, sys\n"
             "import gradientflow_repro.engine\n"
             "assert not {'timm', 'torchvision'} & set(sys.modules), sorted(sys.modules)[-5:]\n"
             "from gradientflow_repro.optim import Lars\n"
             "print(inspect.getsourcefile(Lars))\n"
             "print(importlib.util.find_spec('timm.optim.lars').origin)\n")
    ours, timms = _fresh_process(probe)
    assert ours == timms  # the very file timm ships

    import timm.optim

    from gradientflow_repro.optim import Lars, is_lars

    params = [nn.Parameter(torch.ones(2, 2))]
    assert Lars is timm.optim.Lars
    assert is_lars(Lars(params, lr=0.1)) and is_lars(timm.optim.Lars(params, lr=0.1))
    assert not is_lars(torch.optim.SGD(params, lr=0.1))


def test_a_restored_optimizer_steps_as_the_saved_one_does() -> None:
    """Building, stepping, clearing, saving and restoring the optimizer in a fresh process (torch's
    optimizer methods as shipped: they import ``torch._dynamo`` on first use), and the restored
    optimizer steps as the saved one does."""
    probe = ("import sys, torch\n"
             "from gradientflow_repro.optim import Lars\n"
             "p, q = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3, 3))\n"
             "a, b = Lars([p], lr=0.1, momentum=0.9, weight_decay=0.01), Lars([q], lr=0.1, momentum=0.9)\n"
             "p.grad = torch.full((3, 3), 0.5); a.step(); saved = __import__('io').BytesIO()\n"
             "torch.save(a.state_dict(), saved); saved.seek(0); b.load_state_dict(torch.load(saved)); a.zero_grad()\n"
             "assert p.grad is None\n"
             "with torch.no_grad(): q.copy_(p)\n"
             "p.grad, q.grad = torch.full((3, 3), 0.25), torch.full((3, 3), 0.25); a.step(); b.step()\n"
             "assert torch.equal(p, q)\n"
             "print('stepped alike')\n")
    assert _fresh_process(probe) == ["stepped", "alike"]


def test_without_timm_the_error_names_the_package(monkeypatch) -> None:
    """The GPU check skips an item whose import fails for a missing package it can name."""
    import sys

    from gradientflow_repro import optim

    for loaded in [name for name in sys.modules if name.startswith("timm.")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed: its import fails
    with pytest.raises(ModuleNotFoundError, match="timm is not installed") as raised:
        optim.lars_class()
    assert raised.value.name == "timm"
    with pytest.raises(ModuleNotFoundError, match="timm is not installed"):
        from gradientflow_repro.optim import Lars  # noqa: F401 - the GPU check's import
