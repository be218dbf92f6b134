"""Factorized-FL's initialisation: the authors' Xavier `u`, `v`, `mu` (a full-rank start with
a Xavier layer's variance), `mu-init`, and the defaults that pin them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from models.factorized_fl import (
    FactorizedConv2d,
    FactorizedLinear,
    factorized_layers,
)
from strategies.registry import build_model, load_settings
from tests.conftest import app_config


def test_defaults_pin_the_authors_init_and_todays_aggregation_floor():
    """``factorized-fl.mu-init = "xavier"``: the authors' code (``modules/layers.py``)
    Xavier-initialises ``mu`` (their ``mask``), so layers start full-rank, not as ``u v^T``.
    ``factorized-fl.min-aggregated = 1``: only the client itself is guaranteed (the authors'
    ``minimum_aggr`` is per setting, 20/10 clients label-skewed, 4 multi-domain, in
    ``main.py``). ``factorized-fl.l1 = 0.0005``: the authors' ``lambda_l1`` in every setting
    (the paper's own value not verified)."""
    options = load_settings(app_config(method="factorized-fl")).method_settings
    assert (options.mu_init, options.min_aggregated, options.l1) == ("xavier", 1, 0.0005)


def _average_variance(make, draws: int) -> float:
    torch.manual_seed(0)
    return float(np.mean([make().weight().detach().var().item() for _ in range(draws)]))


@pytest.mark.parametrize(("make", "fan_in", "fan_out", "draws"), [
    (lambda mu_init: FactorizedLinear(nn.Linear(256, 128), mu_init), 256, 128, 20),
    (lambda mu_init: FactorizedLinear(nn.Linear(8, 200), mu_init), 8, 200, 100),
    (lambda mu_init: FactorizedConv2d(nn.Conv2d(1, 32, 3), mu_init), 9, 288, 400),  # first conv
    (lambda mu_init: FactorizedConv2d(nn.Conv2d(64, 64, 3), mu_init), 576, 576, 20),
])
def test_xavier_init_starts_full_rank_with_a_xavier_layers_variance(make, fan_in, fan_out,
                                                                    draws):
    """``u v^T + mu`` starts with exactly a Xavier layer's variance ``2 / (fan_in + fan_out)``
    (the authors' plain sum is up to 2.8 times that, on a one-channel first conv), with ``mu``
    Xavier-like, non-zero and full-rank; ``"zeros"`` keeps the old rank-1 start."""
    xavier = 2 / (fan_in + fan_out)
    assert _average_variance(lambda: make("xavier"), draws) == pytest.approx(xavier, rel=0.05)
    layer = make("xavier")
    weight = layer.weight().detach().reshape(layer.mu.shape[0], -1)
    assert torch.linalg.matrix_rank(weight) == min(weight.shape)
    mu = layer.mu.detach().reshape(layer.mu.shape[0], -1)
    assert torch.count_nonzero(mu) == mu.numel()  # non-zero: every element
    assert torch.linalg.matrix_rank(mu) == min(mu.shape)  # full-rank on its own
    # Xavier-like: uniform within Xavier-uniform's bound sqrt(6 / (fan_in + fan_out)), and
    # spread over most of it (its variance is Xavier's less the small share of u v^T)
    bound = math.sqrt(3 * xavier)
    assert 0.5 * bound < float(mu.abs().max()) <= bound
    old = make("zeros")
    assert torch.count_nonzero(old.mu) == 0
    if isinstance(old, FactorizedLinear):
        assert torch.linalg.matrix_rank(old.weight().detach()) == 1
        assert _average_variance(lambda: make("zeros"), draws) == pytest.approx(1 / fan_in,
                                                                               rel=0.1)


def test_xavier_u_v_are_a_small_addition_on_wide_layers():
    """As in the authors' init: on a wide layer ``u v^T`` carries a few percent of the
    variance, ``mu`` the rest."""
    torch.manual_seed(0)
    layer = FactorizedLinear(nn.Linear(256, 128))
    rank_one = torch.outer(layer.v, layer.u).detach()
    assert rank_one.var() < 0.05 * layer.weight().detach().var()


@pytest.mark.parametrize("mu_init", ["xavier", "zeros"])
def test_the_run_model_initialises_mu_as_configured(mu_init):
    settings = load_settings(app_config(**{"method": "factorized-fl",
                                           "factorized-fl.mu-init": mu_init}))
    model = build_model(settings)
    mus = [m.mu for m in model.modules() if isinstance(m, FactorizedLinear | FactorizedConv2d)]
    assert len(mus) == len(factorized_layers(model)) == 3
    assert all(bool(mu.any()) == (mu_init == "xavier") for mu in mus)


