"""Which clients a round draws, and how many: the same again from the run's seed, except
under central DP, where subsampling amplifies privacy only if nobody, the operator included,
can tell who was drawn."""

from __future__ import annotations

import pytest

from strategies.engine import RoundEngine
from strategies.engine.privacy import PrivacyLedger
from strategies.registry import initial_state, load_settings
from tests.conftest import app_config


def _draws(**overrides) -> list[list[int]]:
    """Five rounds' draws of 10 of 100 nodes by a fresh run's round engine."""
    settings = load_settings(app_config(**overrides))
    engine = RoundEngine(settings, initial_state(settings).wire)
    return [sorted(engine.draw(list(range(100)), 0.1)) for _ in range(5)]


def test_a_runs_draws_follow_its_seed_except_under_central_dp_where_they_are_secret():
    assert _draws() == _draws()
    assert _draws() != _draws(seed=7)
    assert _draws(**{"dp.mode": "local", "seed": 7}) == _draws(seed=7)
    # a seeded draw would repeat; two secret ones agree by chance with odds 1 in 1.7e13^5
    assert _draws(**{"dp.mode": "central"}) != _draws(**{"dp.mode": "central"})


def test_a_round_draws_its_fraction_rounded_down_and_dp_counts_on_the_same_number():
    """As Flower's strategies sample: 10% of 19 nodes is 1, at least one of 5, at most all;
    adaptive clipping's default count noise (m / 20) counts on the m the engine draws."""
    settings = load_settings(app_config(**{
        "dp.mode": "central", "fraction-train": 0.1, "dp.adaptive-clipping": True,
        "dp.noise-multiplier": 0.05}))  # below twice the count's noise, 1 / 20
    engine = RoundEngine(settings, initial_state(settings).wire)
    assert [len(engine.draw(list(range(n)), 0.1)) for n in (100, 19, 5)] == [10, 1, 1]
    assert len(engine.draw(list(range(3)), 1.0)) == 3
    assert engine.draw([], 0.1) == {}  # every node gone: an empty round, not an error
    ledger = PrivacyLedger(settings)
    ledger.fix_population({str(i): {"num-partitions": 19} for i in range(19)})
    assert ledger.expected_drawn() == 1
    assert ledger._noise_multipliers()[1] == pytest.approx(1 / 20)  # the count's noise
