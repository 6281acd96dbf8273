"""Models by name: the large-batch AlexNet-BN and torchvision's alexnet and resnet50."""

from __future__ import annotations

import torchvision
from torch import nn

from gradientflow_repro.models.alexnet_bn import AlexNetBN


def build_model(name: str, num_classes: int, image_size: int, width: float = 1.0,
                dropout: float = 0.5) -> nn.Module:
    if name == "alexnet_bn":
        return AlexNetBN(num_classes, image_size, width, dropout)
    if name == "alexnet":
        return torchvision.models.alexnet(weights=None, num_classes=num_classes, dropout=dropout)
    if name == "resnet50":
        return torchvision.models.resnet50(weights=None, num_classes=num_classes)
    raise ValueError(f"unknown model '{name}' (allowed: alexnet_bn, alexnet, resnet50)")


__all__ = ["AlexNetBN", "build_model"]
