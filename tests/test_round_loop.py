"""The loop that runs the rounds (``server_app/rounds.py: run_rounds``): each round trains
from the arrays the last round produced, a round's record reaches results.json once its
evaluation is in, a DP run whose budget is spent stops before the round that would pass it
(and evaluates the last round it ran), and the loop asks for an evaluation only when one
is pending."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from common.config import ConfigError
from common.durable import load_tree, save_tree
from common.record import RoundRecord
from server_app.results import ResultsRecorder
from server_app.rounds import run_rounds
from server_app.tracking import Tracking
from strategies.engine import (
    BudgetSpentError,
    RoundOutcome,
    RoundPlan,
    RunFailedError,
)
from strategies.registry import load_settings
from tests.conftest import app_config
from tests.test_trust import _engine


def _arrays(value: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.array([value], np.float32))})


def _value(arrays: ArrayRecord) -> float:
    return float(arrays["w"].numpy()[0])


class _ScriptedEngine:
    """What the loop asks of ``RoundEngine``, scripted so that what the loop does shows:
    round ``r``'s training returns arrays holding ``r`` (none in the rounds of
    ``no_update``: no valid reply); under fused evaluation the next round's exchange (or the
    loop's last evaluate exchange) completes its record; planning a round past
    ``budget_rounds`` raises ``BudgetSpentError``, as a DP run's ``dp.target-epsilon`` does;
    the rounds of ``not_evaluated`` are complete once trained (``evaluate-every``), their
    draw kept and asked only as the run's ``last`` evaluation. ``trained`` and ``evaluated``:
    (round, the value of the arrays it was given)."""

    def __init__(self, fused: bool, budget_rounds: int = 100,
                 no_update: tuple[int, ...] = (), not_evaluated: tuple[int, ...] = ()) -> None:
        self.settings = load_settings(app_config(**{"fused-evaluation": fused}))
        self.budget_rounds, self.no_update = budget_rounds, no_update
        self.not_evaluated = not_evaluated
        self.pending: int | None = None  # the round whose evaluation is still to be asked
        self.asked = True  # False: pending for a skipped round, asked only as the last
        self.trained: list[tuple[int, float]] = []
        self.evaluated: list[tuple[int, float]] = []

    def plan_round(self, grid: None, server_round: int, arrays: ArrayRecord) -> RoundPlan:
        if server_round > self.budget_rounds:
            raise BudgetSpentError(f"round {server_round} would pass dp.target-epsilon")
        evaluated, self.pending = self.pending if self.asked else None, None
        return RoundPlan(server_round, {}, {}, evaluated)

    def run_round(self, grid: None, plan: RoundPlan, arrays: ArrayRecord) -> RoundOutcome:
        self.trained.append((plan.round, _value(arrays)))
        completed = () if plan.evaluated is None else (plan.evaluated,)
        updated = None if plan.round in self.no_update else _arrays(plan.round)
        if not self.settings.fused_evaluation:  # the round's own evaluate exchange
            return RoundOutcome(updated, (*completed, self.evaluate_round(
                grid, plan.round, arrays if updated is None else updated)))
        self.pending, self.asked = plan.round, plan.round not in self.not_evaluated
        completed += () if self.asked else (plan.round,)
        return RoundOutcome(updated, completed)

    def evaluate_round(self, grid: None, server_round: int, arrays: ArrayRecord,
                       last: bool = False) -> int:
        self.pending = None
        if server_round in self.not_evaluated and not last:
            self.pending, self.asked = server_round, False
        else:
            self.evaluated.append((server_round, _value(arrays)))
        return server_round

    def evaluation_pending(self) -> bool:
        return self.pending is not None

    def round_record(self, server_round: int) -> RoundRecord:
        return RoundRecord()

    def server_state(self) -> dict:
        return {}

    def snapshot(self, server_round: int) -> dict:
        return {}


def _recorder(engine, tmp_path) -> ResultsRecorder:
    return ResultsRecorder(engine.settings, engine, tmp_path, Tracking([], tmp_path, {}))


@pytest.mark.parametrize("fused", [False, True])
def test_each_round_trains_from_the_arrays_the_last_round_produced(tmp_path, fused):
    """Round 3 has no valid reply: round 4 trains from round 2's arrays."""
    engine = _ScriptedEngine(fused, no_update=(3,))
    recorder = _recorder(engine, tmp_path)
    arrays, stopped = run_rounds(None, engine, recorder, _arrays(0), 1, 4, ["1"])
    assert engine.trained == [(1, 0), (2, 1), (3, 2), (4, 2)]
    assert (_value(arrays), stopped) == (4, "")
    assert [r["round"] for r in recorder.rounds] == [1, 2, 3, 4]
    # fused: only the last round's evaluation is an exchange of its own
    assert engine.evaluated == ([(4, 4)] if fused else [(1, 1), (2, 2), (3, 2), (4, 4)])


def test_a_spent_budget_stops_the_run_before_that_round_and_evaluates_the_last_it_ran(
        tmp_path):
    engine = _ScriptedEngine(fused=True, budget_rounds=2)
    recorder = _recorder(engine, tmp_path)
    arrays, stopped = run_rounds(None, engine, recorder, _arrays(0), 1, 5, ["1"])
    assert stopped == "round 3 would pass dp.target-epsilon" and _value(arrays) == 2
    assert [r for r, _ in engine.trained] == [1, 2] and engine.evaluated == [(2, 2)]
    assert [r["round"] for r in recorder.rounds] == [1, 2]


@pytest.mark.parametrize("fused", [False, True])
def test_a_budget_stop_after_a_skipped_round_evaluates_that_round_once(tmp_path, fused):
    engine = _ScriptedEngine(fused, budget_rounds=3, not_evaluated=(1, 2, 3))
    recorder = _recorder(engine, tmp_path)
    run_rounds(None, engine, recorder, _arrays(0), 1, 20, ["1"])
    assert engine.evaluated == [(3, 3)] and not engine.evaluation_pending()
    assert [r["round"] for r in recorder.rounds] == [1, 2, 3]


@pytest.mark.parametrize("first_round", [1, 4])
def test_a_budget_spent_before_the_first_round_to_run_fails_the_run(tmp_path, first_round):
    """A fresh run, or one resumed at round 4, that may not run a single round fails: its
    results show the rounds before it."""
    engine = _ScriptedEngine(fused=True, budget_rounds=first_round - 1)
    with pytest.raises(RunFailedError, match=rf"^round {first_round} would pass ") as error:
        run_rounds(None, engine, _recorder(engine, tmp_path), _arrays(0), first_round, 5,
                   ["1"])
    assert error.value.through_round == first_round - 1 and engine.trained == []


def test_the_rounds_an_exchange_completed_are_written_in_order(tmp_path):
    """Fused evaluation, rounds 1, 2 and 4 not evaluated: rounds 1 and 2 are complete once
    trained; round 4's exchange completes round 3's record (its evaluation came with it),
    then round 4's own; each record is written once, in round order."""
    engine = _ScriptedEngine(True, not_evaluated=(1, 2, 4))
    recorder = _recorder(engine, tmp_path)
    run_rounds(None, engine, recorder, _arrays(0), 1, 6, ["1"])
    assert [r["round"] for r in recorder.rounds] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(("every", "rounds", "evaluated"), [
    (1, 12, list(range(1, 13))), (3, 12, list(range(3, 13))),
    (10, 35, [10, 20, *range(26, 36)]), (40, 8, list(range(1, 9)))])
def test_evaluate_every_asks_every_kth_round_and_each_of_the_last_ten(every, rounds,
                                                                      evaluated):
    engine, _ = _engine(**{"evaluate-every": every, "num-server-rounds": rounds})
    assert [r for r in range(1, rounds + 1) if engine.evaluation.evaluates(r)] == evaluated


def test_a_checkpoint_after_a_skipped_round_keeps_its_draw_unasked(tmp_path):
    """Saved and loaded as a checkpoint is: the resumed run's next round asks nobody for
    round 3, a budget stop would."""
    engines = [_engine(**{"evaluate-every": 5, "num-server-rounds": 20})[0]
               for _ in range(2)]
    for engine in engines:
        assert engine.nodes.claim(7, "a", 3) is None
    engines[0].evaluation.draw({7: "a"}, asked=False)
    save_tree(tmp_path / "checkpoint.npz", engines[0].snapshot(3))
    resumed = engines[1]
    resumed.restore(load_tree(tmp_path / "checkpoint.npz"))
    resumed.evaluation.resolve(resumed.nodes)
    assert resumed.evaluation_pending() and resumed.evaluation.take() is None
    resumed.restore(load_tree(tmp_path / "checkpoint.npz"))
    resumed.evaluation.resolve(resumed.nodes)
    assert resumed.evaluation.take(last=True) == {7: "a"}


def test_an_evaluate_every_that_would_let_client_ids_expire_stops_at_start():
    with pytest.raises(ConfigError, match=r"^evaluate-every=50 with identity.expire-rounds=50: "):
        load_settings(app_config(**{"evaluate-every": 50}))
    load_settings(app_config(**{"evaluate-every": 49}))  # heard from in time, just
    load_settings(app_config(**{"evaluate-every": 50, "identity.expire-rounds": 0}))
    load_settings(app_config(**{"identity.expire-rounds": 1}))  # every round: as ever


def test_a_finished_run_resumed_with_no_round_left_runs_no_second_evaluation(tmp_path):
    """Its last checkpoint holds no pending evaluation: the loop has nothing to run, and no
    evaluate exchange is sent (this one has no Grid: sending would fail), so results.json
    gets no second entry for the last round. One taken after round 3's training, before its
    evaluation, has it asked. The engine is the real one."""
    engine, arrays = _engine()
    assert engine.evaluation_pending() is False  # nothing drawn before round 1
    recorder = _recorder(engine, tmp_path)
    recorder.rounds = [RoundRecord().entry(r, 1.0) for r in (1, 2, 3)]
    assert run_rounds(None, engine, recorder, arrays, 4, 3, ["1"]) == (arrays, "")
    assert [r["round"] for r in recorder.rounds] == [1, 2, 3]
    # round 3's evaluation pending (drawn here with nobody in it, so no Grid is needed):
    # results.json has rounds 1-2, and round 3 once it is asked
    recorder.rounds = recorder.rounds[:2]
    engine.evaluation.draw({})
    assert engine.evaluation_pending() is True
    run_rounds(None, engine, recorder, arrays, 4, 3, ["1"])
    assert [r["round"] for r in recorder.rounds] == [1, 2, 3]
    assert engine.evaluation_pending() is False


def test_a_skipped_rounds_draw_is_asked_only_as_a_runs_last_evaluation():
    engine, _ = _engine(**{"evaluate-every": 5, "num-server-rounds": 20})
    evaluation = engine.evaluation
    evaluation.expect_rejoined(["a"])  # found rejoining at round 3's admission
    evaluation.draw({7: "a"}, asked=False)  # round 3's, which evaluate-every skips
    assert "a" not in evaluation.rejoined_at_evaluate  # its next score is after it trained
    assert engine.evaluation_pending() and evaluation.take() is None
    assert not engine.evaluation_pending()  # the next round's plan asks nobody for it
    evaluation.draw({7: "a"}, asked=False)
    assert evaluation.take(last=True) == {7: "a"}  # the run stops after round 3
    evaluation.draw({8: "b"})
    assert evaluation.take() == {8: "b"}
