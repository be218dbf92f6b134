"""The method registry: ``method`` name -> the four pieces that make a method (DESIGN 7).

A method is its model transform (``models/``), the rule naming its shared parameters, its
local training step (``client_app/training/``) and its strategy (``strategies/``). Adding a
method means writing those and adding one line to ``_METHODS`` below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from client_app.training import LocalTraining
from common.config import RunSettings
from strategies.base import PersonalizedStrategy


def keep_model(model: nn.Module, settings: RunSettings) -> nn.Module:
    return model


def no_checks(settings: RunSettings) -> None:
    return None


@dataclass(frozen=True)
class Method:
    name: str
    strategy: type[PersonalizedStrategy]
    local_train: Callable[[LocalTraining], float]
    shared_keys: Callable[[nn.Module, RunSettings], list[str]]
    transform: Callable[[nn.Module, RunSettings], nn.Module] = keep_model
    validate: Callable[[RunSettings], None] = no_checks


def _methods() -> list[Method]:
    from strategies import baselines, feddecomp

    return [*baselines.METHODS, feddecomp.METHOD]


REGISTRY: dict[str, Method] = {m.name: m for m in _methods()}


def build_model(settings: RunSettings) -> nn.Module:
    """The run's model, identical on the server and on every client (seeded init)."""
    from fldata import dataset_shape, default_model
    from models import build_backbone

    input_shape, num_classes = dataset_shape(settings)
    torch.manual_seed(settings.seed)
    backbone = build_backbone(default_model(settings), input_shape, num_classes,
                              settings.mlp_hidden)
    return REGISTRY[settings.method].transform(backbone, settings)
