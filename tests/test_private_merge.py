"""Under ``dp.mode = "central"`` a method's server rule merges through the privacy ledger
(``RuleContext.aggregate``): the noised mean over the clients the round's plan drew, never the
run's plain aggregation rule (the ledger's noise itself: test_privacy.py)."""

from __future__ import annotations

import numpy as np
import pytest

from strategies.engine import RoundEngine, RoundPlan
from strategies.registry import REGISTRY, initial_state, load_settings
from tests.conftest import app_config
from tests.test_privacy import population, reply


@pytest.mark.parametrize("method", ["fedavg", "fedper", "feddecomp"])
def test_a_methods_merge_under_central_dp_is_the_noised_mean_over_the_drawn(method):
    """4 clients drawn, 2 send back the arrays they got (no update): the plain mean would
    not move; the ledger's merge moves by its noise alone, of std z C / 4."""
    z, clip_norm = 1.0, 0.5
    settings = load_settings(app_config(method=method, **{
        "dp.mode": "central", "dp.noise-multiplier": z, "dp.clip-norm": clip_norm}))
    start, wire = initial_state(settings)
    engine = RoundEngine(settings, wire, REGISTRY[method].rule)
    population(engine.privacy, 8)
    plan = RoundPlan(1, {100 + i: str(i) for i in range(4)}, {}, None, eligible=8)
    sent = {key: value.numpy() for key, value in start.items()}
    merged, note = engine.merge(plan, [reply("0", sent, 0.0), reply("1", sent, 0.0)], start)
    assert note is not None and note["clipped_fraction"] == 0.0  # for the round's account
    moved = np.concatenate([(merged[key].numpy() - sent[key]).ravel() for key in sent])
    assert moved.size > 5000
    assert np.std(moved) == pytest.approx(z * clip_norm / 4, rel=0.05)



def test_outside_the_engines_round_the_noised_mean_is_over_the_replies():
    """No plan, no draw: a merge outside a round (a test's, or a rule's own after the last
    round) is over the replies it merges, 2 here: noise of std z C / 2."""
    z, clip_norm = 1.0, 0.5
    settings = load_settings(app_config(**{"dp.mode": "central", "dp.noise-multiplier": z,
                                           "dp.clip-norm": clip_norm}))
    start, wire = initial_state(settings)
    engine = RoundEngine(settings, wire, REGISTRY["fedavg"].rule)
    population(engine.privacy, 8)
    sent = {key: value.numpy() for key, value in start.items()}
    merged = engine.rule.merge_updates(1, [reply("0", sent, 0.0), reply("1", sent, 0.0)],
                                       start)
    moved = np.concatenate([(merged[key].numpy() - sent[key]).ravel() for key in sent])
    assert np.std(moved) == pytest.approx(z * clip_norm / 2, rel=0.05)
