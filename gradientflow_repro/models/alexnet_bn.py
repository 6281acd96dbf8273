"""AlexNet with BatchNorm after every conv and fc layer and no LRN.

This is the large-batch AlexNet of You et al. 2017 ("AlexNet-BN") and Jia et al. 2018: BatchNorm is
what lets LARS train it at batch 32K-64K. Two stems: the ImageNet one for 224-pixel crops (11x11
stride-4 conv, 3x3/2 max-pools, 6x6 before the classifier) and a small one for 32-pixel inputs
(3x3 convs, 2x2 pools, 4x4 before the classifier) so the same network family trains on the embedded
digits data. ``width`` scales every channel count (1.0 = the ImageNet network).
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, padding: int = 0) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, padding, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True)]


def _fc_bn(fin: int, fout: int, dropout: float) -> list[nn.Module]:
    return [nn.Dropout(dropout), nn.Linear(fin, fout, bias=False), nn.BatchNorm1d(fout),
            nn.ReLU(inplace=True)]


class AlexNetBN(nn.Module):
    def __init__(self, num_classes: int = 1000, image_size: int = 224, width: float = 1.0,
                 dropout: float = 0.5) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (max(8, int(round(c * width))) for c in (64, 192, 384, 256, 256))
        hidden = max(16, int(round(4096 * width)))
        if image_size >= 128:
            layers = [*_conv_bn(3, c1, 11, 4, 2), nn.MaxPool2d(3, 2),
                      *_conv_bn(c1, c2, 5, padding=2), nn.MaxPool2d(3, 2),
                      *_conv_bn(c2, c3, 3, padding=1), *_conv_bn(c3, c4, 3, padding=1),
                      *_conv_bn(c4, c5, 3, padding=1), nn.MaxPool2d(3, 2)]
            pooled = 6
        else:
            layers = [*_conv_bn(3, c1, 3, padding=1), nn.MaxPool2d(2),
                      *_conv_bn(c1, c2, 3, padding=1), nn.MaxPool2d(2),
                      *_conv_bn(c2, c3, 3, padding=1), *_conv_bn(c3, c4, 3, padding=1),
                      *_conv_bn(c4, c5, 3, padding=1), nn.MaxPool2d(2)]
            pooled = 4
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(pooled)
        self.classifier = nn.Sequential(*_fc_bn(c5 * pooled * pooled, hidden, dropout),
                                        *_fc_bn(hidden, hidden, dropout), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))
