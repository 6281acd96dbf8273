"""Models by name: the large-batch AlexNet-BN and torchvision's alexnet and resnet50."""

from __future__ import annotations

from torch import nn

from gradientflow_repro.models.alexnet_bn import AlexNetBN


def build_model(name: str, num_classes: int, image_size: int, width: float = 1.0,
                dropout: float = 0.5, bn_momentum: float = 0.1) -> nn.Module:
    """``bn_momentum``: the weight of each step's batch statistics in BatchNorm's running estimates
    (PyTorch's default 0.1 averages over about the last 20 steps)."""
    if name == "alexnet_bn":
        model = AlexNetBN(num_classes, image_size, width, dropout)
    elif name in ("alexnet", "resnet50"):
        # imported here: torchvision brings torch._dynamo (seconds per rank), which AlexNet-BN does not need
        from torchvision import models

        model = (models.alexnet(weights=None, num_classes=num_classes, dropout=dropout) if name == "alexnet"
                 else models.resnet50(weights=None, num_classes=num_classes))
    else:
        raise ValueError(f"unknown model '{name}' (allowed: alexnet_bn, alexnet, resnet50)")
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = bn_momentum
    return model


__all__ = ["AlexNetBN", "build_model"]
