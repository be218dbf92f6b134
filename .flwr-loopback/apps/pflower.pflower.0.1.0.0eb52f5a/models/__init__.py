"""Backbones by name. Method-specific model transforms live beside them (``models/<method>.py``)."""

from __future__ import annotations

from collections.abc import Callable

from common.config import ConfigError, one_of
from models.backbones import Backbone, cnn, mlp, resnet8, resnet9, resnet18

BACKBONES: dict[str, Callable[..., Backbone]] = {
    "mlp": mlp,
    "cnn": cnn,
    "resnet8": resnet8,
    "resnet9": resnet9,
    "resnet18": resnet18,
}


def check_backbone(name: str) -> None:
    """An empty ``model`` means the dataset's default; anything else must be a backbone."""
    if name:
        one_of("model", name, BACKBONES)


def build_backbone(name: str, input_shape: tuple[int, ...], num_classes: int,
                   mlp_hidden: int = 200) -> Backbone:
    if name == "mlp":
        return mlp(input_shape, num_classes, mlp_hidden)
    if len(input_shape) != 3:
        raise ConfigError(f"model: {name!r} needs image inputs (C, H, W), got {input_shape}; "
                         "allowed for vector data: mlp")
    return BACKBONES[name](input_shape, num_classes)


__all__ = ["BACKBONES", "Backbone", "build_backbone", "check_backbone"]
