"""The method registry: ``method`` name -> its ``Method`` (``strategies/method.py``), and the
one reading of a whole run config.

Adding a method: write its home (``strategies/<method>/`` and ``models/<method>.py``, see
``strategies/method.py``), then add its record to ``METHODS`` below: one line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from common.config import RunSettings, one_of
from fldata import check_dataset
from models import check_backbone
from strategies import baselines, ditto, factorized_fl, fedala, feddecomp, fedfac, pfedc
from strategies.method import InitialState, Method
from strategies.privacy import refuse_dp
from strategies.wire import WireSpec

METHODS: list[Method] = [
    baselines.FEDAVG, baselines.FEDPROX, baselines.LOCAL, baselines.FEDPER, baselines.FEDREP,
    baselines.FEDBN, baselines.FEDAVG_FT,
    ditto.METHOD,
    fedala.METHOD,
    feddecomp.METHOD,
    pfedc.METHOD,
    factorized_fl.METHOD,
    fedfac.METHOD,
]

REGISTRY: dict[str, Method] = {m.name: m for m in METHODS}


def load_settings(run_config: Mapping[str, Any]) -> RunSettings:
    """Parse and check the whole run config: the general keys, the method's own keys, the
    names of method, dataset and backbone, and the method's rules across keys (on a model
    built on the ``meta`` device). Raises a one-line ``ConfigError``."""
    raw = dict(run_config)
    if "method" in raw and isinstance(raw["method"], str):
        one_of("method", raw["method"], REGISTRY)
    settings = RunSettings.from_run_config(raw)
    method = REGISTRY[one_of("method", settings.method, REGISTRY)]
    check_dataset(settings)
    check_backbone(settings.model)
    settings = settings.with_method(method.settings.parse(raw) if method.settings else None)
    refuse_dp(settings, method.dp_refused)
    with torch.device("meta"):
        method.check(settings, method.build_model(settings))
    return settings


def build_model(settings: RunSettings) -> nn.Module:
    """The run's model, identical on the server and on every client (seeded init)."""
    return REGISTRY[settings.method].build_model(settings)


def wire_spec(settings: RunSettings) -> WireSpec:
    """The run's wire spec (see ``strategies/wire.py``)."""
    return REGISTRY[settings.method].wire_spec(settings)


def initial_state(settings: RunSettings) -> InitialState:
    """What the server starts from: the shared arrays of round 1 and the wire spec."""
    return REGISTRY[settings.method].initial_state(settings)
