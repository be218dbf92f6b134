"""Backbones. Every one is ``body`` (the feature extractor) followed by ``head`` (one Linear).

Methods rely on this split: ``head.*`` is the classifier (FedPer/FedRep keep it private,
pFedC replaces it by branches), everything under ``body.*`` is the representation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


def forward_calls(model: nn.Module, input_shape: tuple[int, ...],
                  kinds: type[nn.Module] | tuple[type[nn.Module], ...]
                  ) -> tuple[Any, list[tuple[str, Tensor, Any]]]:
    """``model``'s output on a batch of two ``input_shape`` zeros, and the calls of its
    ``kinds`` submodules in the order they ran: (name, first input, output). Forward order is
    what "the layer before the classifier" means in a model that registers its layers in
    another order. Run in eval mode (one sample per BatchNorm channel is fine, and its
    statistics stay as they are), without gradients; the training flag is restored."""
    calls: list[tuple[str, Tensor, Any]] = []
    hooks = [module.register_forward_hook(
        lambda _module, inputs, output, name=name: calls.append((name, inputs[0], output)))
        for name, module in model.named_modules() if isinstance(module, kinds)]
    parameter = next(model.parameters(), None)
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            output = model(torch.zeros(2, *input_shape, device=parameter.device
                                       if parameter is not None else None))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(was_training)
    return output, calls


class Backbone(nn.Module):
    """``head(body(x))``, with the body's output flattened; ``head`` a fresh Linear unless one
    is given (a user's model keeps its own classifier, ``models/user.py``)."""

    def __init__(self, body: nn.Module, feature_dim: int, num_classes: int,
                 head: nn.Linear | None = None) -> None:
        super().__init__()
        self.body = body
        self.head = head if head is not None else nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim

    def features(self, x: Tensor) -> Tensor:
        return self.body(x).flatten(1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int) -> Backbone:
    """One hidden ReLU layer: the FedFac paper's simulation model."""
    body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
    return Backbone(body, hidden, num_classes)


def _conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True)]


def cnn(input_shape: tuple[int, ...], num_classes: int, hidden: int = 128) -> Backbone:
    """Two conv-BN-ReLU blocks and one hidden Linear; works from 8x8 inputs upwards."""
    body = nn.Sequential(
        *_conv_bn(input_shape[0], 32), nn.MaxPool2d(2),
        *_conv_bn(32, 64), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
        nn.Linear(64 * 4, hidden), nn.ReLU(inplace=True),
    )
    return Backbone(body, hidden, num_classes)


def lenet5(input_shape: tuple[int, ...], num_classes: int, hidden: int = 0) -> Backbone:
    """LeNet-5 (LeCun et al. 1998; the pFedC paper's MNIST model): two 5x5 convolutions (6 and
    16 channels) with max pooling, then Linear layers of 120 and 84. BatchNorm after each
    convolution, so that FedBN and personal BatchNorm statistics have something to keep;
    about 1/9 of the CNN's multiply-adds on 28x28 images (a third of its time on CPU). Works
    from 8x8 inputs upwards (the first convolution pads by 2, the second is cut to the
    input's size)."""
    side = min(input_shape[1:]) // 2            # after the first pooling
    kernel = min(5, side)
    pooled = (side - kernel + 1) // 2 or 1
    body = nn.Sequential(
        nn.Conv2d(input_shape[0], 6, 5, padding=2), nn.BatchNorm2d(6), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, kernel), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveMaxPool2d(pooled), nn.Flatten(),
        nn.Linear(16 * pooled * pooled, 120), nn.ReLU(inplace=True),
        nn.Linear(120, 84), nn.ReLU(inplace=True),
    )
    return Backbone(body, 84, num_classes)


class BasicBlock(nn.Module):
    """The two-conv residual block of ResNet-18 (He et al. 2016)."""

    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _resnet(input_shape: tuple[int, ...], num_classes: int, widths: list[int],
            blocks: int) -> Backbone:
    """CIFAR-style ResNet: 3x3 stem, one stage per width (stride 2 after the first)."""
    layers: list[nn.Module] = _conv_bn(input_shape[0], widths[0])
    cin = widths[0]
    for i, width in enumerate(widths):
        for b in range(blocks):
            layers.append(BasicBlock(cin, width, 2 if (i > 0 and b == 0) else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return Backbone(nn.Sequential(*layers), cin, num_classes)


def resnet8(input_shape: tuple[int, ...], num_classes: int, hidden: int = 0) -> Backbone:
    return _resnet(input_shape, num_classes, [16, 32, 64], blocks=1)


def resnet18(input_shape: tuple[int, ...], num_classes: int, hidden: int = 0) -> Backbone:
    return _resnet(input_shape, num_classes, [64, 128, 256, 512], blocks=2)


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.block = nn.Sequential(*_conv_bn(width, width), *_conv_bn(width, width))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x)


def resnet9(input_shape: tuple[int, ...], num_classes: int, hidden: int = 0) -> Backbone:
    """The DAWNBench ResNet-9 (prep, three stages, two residual blocks)."""
    body = nn.Sequential(
        *_conv_bn(input_shape[0], 64),
        *_conv_bn(64, 128), nn.MaxPool2d(2), _Residual(128),
        *_conv_bn(128, 256), nn.MaxPool2d(2),
        *_conv_bn(256, 512), nn.MaxPool2d(2), _Residual(512),
        nn.AdaptiveMaxPool2d(1), nn.Flatten(),
    )
    return Backbone(body, 512, num_classes)
