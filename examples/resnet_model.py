"""The wide ResNets RaNNC trains (BiT's naming): `resnet50x1` ... `resnet152x8`, bottleneck ResNets with
every channel count times the width factor (resnet152x8: 3.7 B parameters), as plain nn.Modules.

The layout is torchvision's ResNet v1.5 (stride in the 3x3 conv, BatchNorm after every conv, zero-init of
each block's last BN scale is not applied so a tiny model learns fast): stem 7x7/2 conv of 64·w channels,
3x3/2 max pool, four stages of bottlenecks with 64·w, 128·w, 256·w, 512·w inner channels (x4 out),
global average pool, linear head. `base` (64) scales the stem width for tiny CPU runs.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}
NAME = re.compile(r"^resnet(50|101|152)x(\d+)$")


class Bottleneck(nn.Module):
    def __init__(self, cin: int, inner: int, stride: int) -> None:
        super().__init__()
        out = inner * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, inner, 1, bias=False), nn.BatchNorm2d(inner)
        self.conv2, self.bn2 = nn.Conv2d(inner, inner, 3, stride, 1, bias=False), nn.BatchNorm2d(inner)
        self.conv3, self.bn3 = nn.Conv2d(inner, out, 1, bias=False), nn.BatchNorm2d(out)
        self.down = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                     if stride != 1 or cin != out else None)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.bn1(self.conv1(x)))
        h = self.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return self.relu(h + (x if self.down is None else self.down(x)))


class WideResNet(nn.Module):
    def __init__(self, depth: int, width: int, classes: int = 1000, base: int = 64) -> None:
        super().__init__()
        c = base * width
        self.stem = nn.Sequential(nn.Conv2d(3, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], c
        for k, n in enumerate(DEPTHS[depth]):
            inner = c * 2 ** k
            blocks = [Bottleneck(cin if i == 0 else inner * 4, inner, 2 if (i == 0 and k > 0) else 1) for i in range(n)]
            stages.append(nn.Sequential(*blocks))
            cin = inner * 4
        self.layers = nn.Sequential(*stages)
        self.pool, self.head = nn.AdaptiveAvgPool2d(1), nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def build(name: str, *, classes: int = 1000, base: int = 64) -> WideResNet:
    """`resnet101x4` -> a WideResNet(101, 4); ValueError naming the valid names otherwise."""
    match = NAME.match(name)
    if match is None:
        raise ValueError(f"unknown model {name!r}: use resnet{{50,101,152}}x{{width}}, e.g. resnet50x1, resnet152x8")
    return WideResNet(int(match[1]), int(match[2]), classes, base)


def param_count(name: str) -> int:
    """Parameters of the full-size model, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(name).parameters())
