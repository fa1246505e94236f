"""Networks by name, with the right number of classes and input channels and a stem for small images."""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torchvision import models as tv

SMALL_IMAGE = 64  # at or below this side, torchvision's ImageNet stems downsample too early


class TinyCNN(nn.Module):
    """conv32-conv64-pool-fc128: the default job's network, seconds to train on the CPU."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        pooled = image_size // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * pooled * pooled, 128), nn.ReLU(inplace=True), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _resnet(factory, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    model = factory(num_classes=num_classes)
    if image_size <= SMALL_IMAGE:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    return model


def _mobilenet(factory, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    model = factory(num_classes=num_classes)
    stem = model.features[0][0]
    stride = 1 if image_size <= SMALL_IMAGE else 2
    model.features[0][0] = nn.Conv2d(in_channels, stem.out_channels, 3, stride=stride, padding=1, bias=False)
    return model


def _vgg11(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    model = tv.vgg11(num_classes=num_classes)
    model.features[0] = nn.Conv2d(in_channels, 64, 3, padding=1)
    if image_size <= SMALL_IMAGE:
        # The CIFAR-style head (512-512-classes): the ImageNet head would be 100M parameters of padding.
        model.avgpool = nn.AdaptiveAvgPool2d(1)
        model.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(512, num_classes),
        )
    return model


def _alexnet(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    model = tv.alexnet(num_classes=num_classes)
    model.features[0] = nn.Conv2d(in_channels, 64, 11, stride=4, padding=2)
    return model


BUILDERS = {
    "tiny_cnn": TinyCNN,
    "resnet18": lambda k, c, s: _resnet(tv.resnet18, k, c, s),
    "resnet50": lambda k, c, s: _resnet(tv.resnet50, k, c, s),
    "mobilenet_v3_small": lambda k, c, s: _mobilenet(tv.mobilenet_v3_small, k, c, s),
    "mobilenet_v3_large": lambda k, c, s: _mobilenet(tv.mobilenet_v3_large, k, c, s),
    "vgg11": _vgg11,
    "alexnet": _alexnet,
}


def build_model(name: str, num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """A built-in network, or `package.module:callable` called as callable(num_classes, in_channels, image_size)."""
    if ":" in name:
        module_name, attr = name.split(":")
        factory = getattr(importlib.import_module(module_name), attr)
        return factory(num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    return BUILDERS[name](num_classes, in_channels, image_size)
