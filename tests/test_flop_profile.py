"""The FLOP-based profile (``scaling/profile.py``): exact counts on layers small enough to count by
hand, and on AlexNet-BN at 224 the property that motivates it, that the convolutions do most of
backward's work while the fully connected layers hold most of the parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradientflow_repro.models import build_model
from gradientflow_repro.scaling import perfmodel as pm
from gradientflow_repro.scaling import profile
from gradientflow_repro.scaling.profile import flop_profile, flop_readiness, flops_per_image, readiness_table


def test_linear_counts_by_hand() -> None:
    # forward: addmm of (3x10)(10x5) = 2*3*10*5; backward: the weight's gradient only (the same
    # size of product), since the input needs no gradient and the bias's gradient is a sum
    counted = flop_readiness(nn.Linear(10, 5), torch.randn(3, 10), torch.randint(0, 5, (3,)))
    assert counted.forward_flops == 2 * 3 * 10 * 5 == 300
    assert counted.backward_flops == 300
    assert sorted((t.elements, t.backward_flops_done, t.one_dimensional) for t in counted.tensors) == [
        (5, 300, True), (50, 300, False)]


def test_two_layers_count_the_inner_input_gradient() -> None:
    model = nn.Sequential(nn.Linear(10, 5, bias=False), nn.Linear(5, 4))
    forward, backward, tensors = flop_readiness(model, torch.randn(3, 10), torch.randint(0, 4, (3,)))
    assert forward == 2 * 3 * 10 * 5 + 2 * 3 * 5 * 4
    # second layer: its weight's and its input's gradients (120 each); first: its weight's (300)
    assert backward == 120 + 120 + 300
    assert {t.elements: t.backward_flops_done for t in tensors} == {4: 240, 20: 240, 50: 540}
    assert tensors[-1].elements == 50  # the first layer's gradient is complete last


def test_convolution_backward_counts_input_gradient_only_when_needed() -> None:
    conv = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.Flatten())
    images, labels = torch.randn(1, 3, 8, 8), torch.randint(0, 4 * 6 * 6, (1,))
    per_pass = 2 * 4 * 6 * 6 * 3 * 3 * 3  # output elements x multiply-adds per output
    assert flop_readiness(conv, images, labels)[:2] == (per_pass, per_pass)
    assert flop_readiness(conv, images.requires_grad_(True), labels)[:2] == (per_pass, 2 * per_pass)


def test_alexnet_bn_convolutions_do_the_backward_work_fc_layers_hold_the_parameters() -> None:
    model = build_model("alexnet_bn", 1000, 224)
    fc = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert fc / sum(p.numel() for p in model.parameters()) > 0.9
    counted = flops_per_image("alexnet_bn", 224, 1000)
    assert 1.3e9 < counted.forward_flops < 1.5e9  # AlexNet's well-known ~0.71 G multiply-adds
    weights = [t for t in counted.tensors if not t.one_dimensional]
    # backward reaches the first fully connected layer (9216 x 4096) having done only the
    # classifier's work: everything after it is the convolutions'
    fc1 = next(t for t in weights if t.elements == 9216 * 4096)
    assert 1 - fc1.backward_flops_done / counted.backward_flops > 0.8
    assert weights[-1].elements == 64 * 3 * 11 * 11 and weights[-1].backward_flops_done == counted.backward_flops


def test_alexnet_bn_profile_readiness() -> None:
    step = pm.PAPER_PER_GPU_BATCH / pm.PAPER_SINGLE_GPU_IMAGES_S
    flops = flop_profile("alexnet_bn", 224, pm.PAPER_PER_GPU_BATCH, pm.PAPER_SINGLE_GPU_IMAGES_S)
    assert flops.forward_s + flops.backward_s == pytest.approx(step)
    assert 0.6 < flops.backward_s / step < 0.7  # backward's FLOPs are ~1.9x forward's
    ready = [t.ready_s for t in flops.tensors]
    assert ready == sorted(ready) and ready[-1] == pytest.approx(flops.backward_s)
    table = readiness_table(flops, pm.paper_profile())
    by_size = {elements: fraction for elements, fraction, _ in table}
    assert all(by_size[fc] < 0.2 for fc in (1000 * 4096, 4096 * 4096, 9216 * 4096))  # the classifier: early
    assert table[-1][:2] == (64 * 3 * 11 * 11, 1.0)  # the first convolution: last
    # by parameter count every other weight is ready later (the first fc layer at 0.96 instead of 0.09)
    assert all(fraction < spread for _, fraction, spread in table[:-1])
    assert by_size[9216 * 4096] < 0.1 and dict((e, s) for e, _, s in table)[9216 * 4096] > 0.9


def test_a_torchvision_model_that_is_not_ours() -> None:
    counted = flops_per_image("resnet18", 64, 10)
    params = list(profile.build_named_model("resnet18", 10, 64).parameters())
    assert sorted(t.elements for t in counted.tensors) == sorted(p.numel() for p in params)
    assert 0 < counted.forward_flops < flops_per_image("resnet50", 64, 10).forward_flops  # a deeper relative
    assert 1.5 < counted.backward_flops / counted.forward_flops <= 2  # no input gradient for the first conv
    made = flop_profile("resnet18", 64, 32, 1000.0, num_classes=10, optimizer_s=0.002)
    assert made.forward_s + made.backward_s + made.optimizer_s == pytest.approx(0.032)


def test_unknown_name_says_where_it_looked() -> None:
    with pytest.raises(ValueError, match="unknown model 'no_such_net'.*alexnet_bn.*torchvision.*timm"):
        flops_per_image("no_such_net", 224, 1000)
    with pytest.raises(ValueError, match="optimizer_s"):
        flop_profile("alexnet_bn", 224, 128, 3300.0, optimizer_s=1.0)


class _ReadsAValue(nn.Module):
    """A model the meta device cannot run: it reads a value with ``.item()``."""

    def __init__(self, image_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * image_size * image_size, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, 1)
        return self.fc(x * 2 if x.abs().max().item() > 0 else x)


def test_falls_back_to_cpu_when_meta_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(profile, "build_named_model", lambda name, classes, size: _ReadsAValue(size))
    counted = flops_per_image.__wrapped__("reads_a_value", 4, 5)  # uncached: the name is made up
    assert (counted.forward_flops, counted.backward_flops) == (2 * 48 * 5, 2 * 48 * 5)


def test_counting_is_cached() -> None:
    flops_per_image("alexnet_bn", 224, 1000)
    hits = flops_per_image.cache_info().hits
    flop_profile("alexnet_bn", 224, 64, 3000.0)
    assert flops_per_image.cache_info().hits == hits + 1
