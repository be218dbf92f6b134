"""The method registry: ``method`` name -> its ``Method`` (see ``strategies/method.py``).

A method is its model transform (``models/``), the rule naming its shared parameters, its
local training step (``client_app/training/``) and its strategy (``strategies/``). Adding a
method means writing those and adding it to ``_methods()`` below: one line.
"""

from __future__ import annotations

import torch
from torch import nn

from common.config import RunSettings
from strategies.method import Method


def build_model(settings: RunSettings) -> nn.Module:
    """The run's model, identical on the server and on every client (seeded init)."""
    from fldata import dataset_shape, default_model
    from models import build_backbone

    input_shape, num_classes = dataset_shape(settings)
    torch.manual_seed(settings.seed)
    backbone = build_backbone(default_model(settings), input_shape, num_classes,
                              settings.mlp_hidden)
    return REGISTRY[settings.method].transform(backbone, settings)


def _methods() -> list[Method]:
    from strategies import baselines, factorized_fl, feddecomp, fedfac, pfedc

    return [*baselines.METHODS, feddecomp.METHOD, pfedc.METHOD, factorized_fl.METHOD,
            fedfac.METHOD]


REGISTRY: dict[str, Method] = {m.name: m for m in _methods()}
