"""Models a user brings (``model = "user_models:<factory>"``), for the tests of models/user.py.

This folder is on the PYTHONPATH of the tests' federation (tests/conftest.py), as a user's
own module would be installed or on PYTHONPATH at every site.
"""

from __future__ import annotations

import torch
from torch import nn


class ClassifierFirst(nn.Module):
    """Layers registered out of forward order: the classifier first, then the hidden
    Linear, then the BatchNorm'd conv stage that runs first."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.classifier = nn.Linear(32, num_classes)
        self.hidden = nn.Linear(8 * 4 * 4, 32)
        self.stage = nn.Sequential(nn.Conv2d(input_shape[0], 8, 3, padding=1),
                                   nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.hidden(self.stage(x).flatten(1)))
        return self.classifier(features)


def classifier_first(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return ClassifierFirst(input_shape, num_classes)


def resnet18(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """The README's torchvision factory, as a user copies it."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(input_shape[0], 64, 3, padding=1, bias=False)
    return model


class SoftmaxAtTheEnd(ClassifierFirst):
    """Returns probabilities, not the classifier's logits: the rule cannot serve it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).softmax(1)


def softmax_at_the_end(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return SoftmaxAtTheEnd(input_shape, num_classes)


def not_a_module(input_shape: tuple[int, ...], num_classes: int) -> object:
    return "a string"
