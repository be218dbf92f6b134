"""Which clients a round draws: the run's seed alone decides (outside central DP), whatever
else in the ServerApp's process draws random numbers, and a resumed run draws on as the run
it continues would have."""

from __future__ import annotations

import random

from strategies.engine import RoundEngine
from strategies.registry import REGISTRY, initial_state, load_settings
from tests.conftest import app_config

ELIGIBLE = list(range(100, 120))


def _engine(**overrides) -> RoundEngine:
    settings = load_settings(app_config(method="fedavg", **{"fraction-train": 0.3,
                                                            **overrides}))
    return RoundEngine(settings, initial_state(settings).wire, REGISTRY["fedavg"].rule)


def test_the_draws_do_not_move_when_something_else_draws_from_the_global_random():
    """Flower's heartbeat thread draws from the module's ``random`` at times that vary
    between runs; the engine's draws must not depend on it."""
    quiet = _engine()
    expected = [quiet.draw(ELIGIBLE, 0.3) for _ in range(3)]
    busy = _engine()
    drawn = []
    for k in range(3):
        random.seed(k)  # whatever the global generator holds, and whoever draws from it
        random.random()
        drawn.append(busy.draw(ELIGIBLE, 0.3))
    assert drawn == expected
    assert len({tuple(d) for d in expected}) == 3  # a new draw each round
    assert _engine(seed=7).draw(ELIGIBLE, 0.3) != expected[0]  # the seed decides


def _engine_after(draws: int) -> RoundEngine:
    engine = _engine()
    for _ in range(draws):
        engine.draw(ELIGIBLE, 0.3)
    return engine


def test_a_restored_snapshot_draws_on_as_the_run_it_continues():
    run = _engine_after(3)
    resumed = _engine()
    resumed.restore(run.snapshot(3))
    assert [resumed.draw(ELIGIBLE, 0.3) for _ in range(3)] == \
        [run.draw(ELIGIBLE, 0.3) for _ in range(3)]


def test_a_secret_draw_under_central_dp_keeps_no_state_in_the_checkpoint():
    engine = _engine(**{"dp.mode": "central"})
    assert "random" not in engine.snapshot(1)
