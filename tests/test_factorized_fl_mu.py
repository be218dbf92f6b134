"""Factorized-FL's mu density (models/factorized_fl.py: ``mu_density``): what a client reports
of its personal part after local training, and the round's figure its rule records."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.engine import RoundEngine
from strategies.factorized_fl.server import FactorizedFLRule
from strategies.registry import initial_state, load_settings, wire_spec
from tests.conftest import app_config
from tests.test_factorized_fl import _upload


def test_a_factorized_fl_client_reports_mu_density_and_the_rule_its_example_weighted_mean():
    """mu never leaves the client: its density (the share of mu's elements above 1e-3 after
    local training, the paper's sparse bias made measurable) comes with the train reply, and
    the rule reports the round's example-weighted mean as results.json's ``mu_density``."""
    import torch

    from models.factorized_fl import MU_DENSITY, MU_ZERO, mu_density
    from strategies.registry import REGISTRY

    method = REGISTRY["factorized-fl"]
    settings = load_settings(app_config(method="factorized-fl"))
    model = method.build_model(settings)
    with torch.no_grad():
        mus = [p for name, p in model.named_parameters() if name.endswith(".mu")]
        for p in mus:
            p.zero_()
        mus[0].view(-1)[:10] = 2 * MU_ZERO  # ten elements above the threshold, the rest zero
    total = sum(p.numel() for p in mus)
    assert method.train_metrics(model) == {MU_DENSITY: pytest.approx(10 / total)}
    assert mu_density(model) == pytest.approx(10 / total)
    # the rule: the round's example-weighted mean, in the round's record
    settings = load_settings(app_config(method="factorized-fl"))
    arrays = initial_state(settings).arrays
    engine = RoundEngine(settings, wire_spec(settings), FactorizedFLRule)
    replies = [_upload(settings, c, np.random.default_rng(int(c)), n) for c, n in (("0", 10),
                                                                                  ("1", 30))]
    for reply, density in zip(replies, (0.2, 0.6), strict=True):
        reply.metrics[MU_DENSITY] = density
    engine.rule.merge_updates(1, replies, arrays)
    assert engine.round_record(1).extra["mu_density"] == pytest.approx((10 * 0.2 + 30 * 0.6)
                                                                      / 40)
