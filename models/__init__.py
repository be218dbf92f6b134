"""Backbones by name, or a user's own (``package.module:factory``, ``models/user.py``).
Method-specific model transforms live beside them (``models/<method>.py``)."""

from __future__ import annotations

from collections.abc import Callable

from common.config import ConfigError, one_of
from models.backbones import Backbone, cnn, lenet5, mlp, resnet8, resnet9, resnet18
from models.user import FACTORY_FORM, build_user_backbone, is_factory, load_factory

BACKBONES: dict[str, Callable[..., Backbone]] = {
    "mlp": mlp,
    "cnn": cnn,
    "lenet5": lenet5,
    "resnet8": resnet8,
    "resnet9": resnet9,
    "resnet18": resnet18,
}


def check_backbone(name: str) -> None:
    """An empty ``model`` means the dataset's default; anything else must be a backbone or
    an importable factory."""
    if is_factory(name):
        load_factory(name)
    elif name and name not in BACKBONES:
        one_of("model", name, [*BACKBONES, FACTORY_FORM])


def build_backbone(name: str, input_shape: tuple[int, ...], num_classes: int,
                   mlp_hidden: int = 200) -> Backbone:
    if is_factory(name):
        return build_user_backbone(name, input_shape, num_classes)
    if name == "mlp":
        return mlp(input_shape, num_classes, mlp_hidden)
    if len(input_shape) != 3:
        raise ConfigError(f"model: {name!r} needs image inputs (C, H, W), got {input_shape}; "
                         "allowed for vector data: mlp")
    return BACKBONES[name](input_shape, num_classes)


__all__ = ["BACKBONES", "Backbone", "build_backbone", "check_backbone"]
