"""The one orchestrator of compare, the matrix and run_methods (``comparison/runs.py``): a
stored run is reused only when its numbers are today's, a failed run is not stored, a
diverged one only where the caller counts it as a result. The runner here writes the
results.json a run would (the real runs: tests/test_matrix.py, tests/test_compare.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from common.record import lost_to_non_finite
from comparison.runs import RunStore
from comparison.stats import comparable_config
from launch.app_project import app_defaults
from strategies.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
RESULTS = {"status": "completed",
           "rounds": [{"round": 1, "bytes_up": 0,
                       "eval": {"accuracy_weighted": 0.5, "accuracy_min": 0.4}}],
           "final": {"accuracy_weighted": 0.5, "accuracy_min": 0.4, "accuracy_mean": 0.5,
                     "bytes_up_total": 0, "seconds_total": 1.0}}


@dataclass
class Ended:
    ok: bool
    status: str
    reason: str = ""
    output: str = ""


class WritingRunner:
    """Writes ``results`` into the run's output-dir and says how it ended; counts calls."""

    def __init__(self, results: dict[str, Any], ok: bool = True) -> None:
        self.results, self.ok, self.calls = results, ok, 0

    def __call__(self, run_config: dict[str, Any], context: dict[str, Any]) -> Ended:
        self.calls += 1
        out = Path(run_config["output-dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(self.results))
        return Ended(self.ok, "finished:completed" if self.ok else "finished:failed",
                     self.results.get("reason", ""))


def config(tmp_path: Path, method: str = "fedavg", **keys: Any) -> dict[str, Any]:
    return {"method": method, "seed": 1, "output-dir": str(tmp_path / "run"), **keys}


def test_a_run_is_stored_once_and_reused_while_its_numbers_are_todays(tmp_path):
    runner = WritingRunner(RESULTS)
    store = RunStore(app_defaults(ROOT), REGISTRY, runner, stamp=lambda: {"commit": "abc"})
    record = tmp_path / "fedavg.json"
    first = store.get(record, config(tmp_path), name="fedavg", about={"row": "fedavg"},
                      context={"num_clients": 3})
    assert runner.calls == 1 and first["accuracy_per_round"] == [0.5]
    assert first["row"] == "fedavg" and first["commit"] == "abc" and first["num_clients"] == 3
    assert json.loads(record.read_text()) == first
    assert store.get(record, config(tmp_path), name="fedavg",
                     context={"num_clients": 3}) == first
    assert runner.calls == 1
    # what changes no number: where it writes, whether it is tracked, the device
    moved = config(tmp_path / "elsewhere", tracking="mlflow", device="cpu")
    assert store.get(record, moved, name="fedavg", context={"num_clients": 3}) == first
    assert runner.calls == 1


def test_evaluate_every_counts_only_where_it_may_change_a_figure():
    everyone = {"lr": 0.1, "evaluate-every": 10, "fraction-evaluate": 1.0,
                "identity.expire-rounds": 50}
    assert comparable_config(everyone) == {k: v for k, v in everyone.items()
                                           if k != "evaluate-every"}
    for change in ({"dp.target-epsilon": 3.0},  # a budget stop before the last rounds
                   {"fraction-evaluate": 0.5}):  # a client may go unheard until it expires
        assert comparable_config({**everyone, **change}) == {**everyone, **change}
    assert "evaluate-every" not in comparable_config(
        {**everyone, "fraction-evaluate": 0.5, "identity.expire-rounds": 0})


@pytest.mark.parametrize(("change", "current"), [
    ({"defaults": {"weight-decay": 0.1}}, False),   # a general default changed since
    ({"defaults": {"some-new-option": 1}}, True),   # a key added since, at its default
    ({"defaults": {"fedfac.layers": "0"}}, True),   # another method's default
    ({"run": {"fedfac.layers": "0"}}, True),        # another method's key set in the run
    ({"run": {"lr": 0.3}}, False),                  # a setting of the run
    ({"run": {"evaluate-every": 10}}, True),        # a thinner curve, the same figures
    ({"context": {"num_clients": 4}}, False),       # another data split
])
def test_the_one_staleness_rule(tmp_path, change, current):
    """Where the compare command's old rule and the matrix's differed (another method's
    key), and what both already agreed on."""
    defaults = app_defaults(ROOT)
    store = RunStore(defaults, REGISTRY, WritingRunner(RESULTS))
    record = tmp_path / "fedavg.json"
    stored = store.get(record, config(tmp_path), name="fedavg", context={"num_clients": 3})
    today = RunStore({**defaults, **change.get("defaults", {})}, REGISTRY)
    again = today.get(record, config(tmp_path, **change.get("run", {})), name="fedavg",
                      context={"num_clients": 3, **change.get("context", {})})
    assert (again == stored) is current and (again is None) is not current


def test_a_failed_run_is_not_stored_and_a_diverged_one_only_where_it_is_a_result(tmp_path,
                                                                                  capsys):
    diverged = {"status": "failed", "reason": "round 3: metric 'loss' is not finite"}
    store = RunStore(app_defaults(ROOT), REGISTRY, WritingRunner(diverged, ok=False))
    record = tmp_path / "lr0.3.json"
    assert store.get(record, config(tmp_path, lr=0.3), name="lr 0.3") is None
    assert not record.exists()
    assert store.failed == [f"lr 0.3: {diverged['reason']}"]
    assert "lr 0.3: run failed" in capsys.readouterr().err
    kept = store.get(record, config(tmp_path, lr=0.3), name="lr 0.3", diverged_is_result=True)
    assert kept["status"] == "diverged" and kept["reason"] == diverged["reason"]
    assert json.loads(record.read_text()) == kept
    # a crash or a timeout is never a result
    crashed = RunStore(app_defaults(ROOT), REGISTRY,
                       WritingRunner({"status": "failed", "reason": "round 2: no reply"},
                                     ok=False))
    other = tmp_path / "crashed.json"
    assert crashed.get(other, config(tmp_path), name="x", diverged_is_result=True) is None
    assert not other.exists()


def _rounds(n: int, dropped: dict[int, list[dict[str, str]]]) -> dict[str, Any]:
    """A completed run of ``n`` evaluated rounds, with ``dropped`` replies by round."""
    return {**RESULTS, "rounds": [
        {"round": r, "bytes_up": 0, "eval": {"accuracy_weighted": 0.5, "accuracy_min": 0.4},
         **({"dropped": dropped[r]} if r in dropped else {})} for r in range(1, n + 1)]}


NAN = {"stage": "train", "client": "3", "reason": "metric 'train-loss' is not finite"}
NAN_ARRAY = {"stage": "train", "client": "4", "reason": "'w' has values that are not finite"}
LATE = {"stage": "evaluate", "client": "3", "reason": "no reply within round-timeout (600 s)"}
ERRED = {"stage": "train", "client": "3", "reason": "ClientAppException: ValueError: no data"}
REFUSED = {"stage": "train", "client": "3", "reason": "client id 3 is held by live node 7"}


def test_a_run_that_lost_clients_to_non_finite_values_in_its_last_rounds_diverged(tmp_path):
    """Its accuracy would be over the clients that survived (local DP at noise 1.0 left
    one client, whose accuracy 1.0 was the run's): a divergence, never a figure."""
    # rounds 6-10 are the figure's (the last LAST_ROUNDS evaluated): 6 is the first of them
    lost = _rounds(10, {6: [NAN], 9: [NAN_ARRAY]})
    lost["final"] = {**lost["final"], "privacy": {"epsilon": 110.0, "delta": 0.04}}
    store = RunStore(app_defaults(ROOT), REGISTRY, WritingRunner(lost))
    record = tmp_path / "z1.json"
    assert store.get(record, config(tmp_path), name="z 1") is None and not record.exists()
    assert store.failed[0].startswith("z 1: rounds 6-10: the replies of 2 client(s) were "
                                      "not finite")
    kept = store.get(record, config(tmp_path), name="z 1", diverged_is_result=True)
    assert kept["status"] == "diverged" and "accuracy_weighted" not in kept
    assert kept["privacy"]["epsilon"] == 110.0  # what it spent, diverged or not
    # a client lost before the figure's rounds, to its own error, or refused by the server
    # (strategies/engine/identity.py) leaves a figure: the same on every try
    for index, results in enumerate((_rounds(10, {5: [NAN]}), _rounds(10, {9: [ERRED]}),
                                     _rounds(10, {8: [REFUSED]}))):
        store = RunStore(app_defaults(ROOT), REGISTRY, WritingRunner(results))
        got = store.get(tmp_path / f"other{index}.json", config(tmp_path), name="x")
        assert got["accuracy_weighted"] == 0.5 and store.failed == []


def test_a_run_that_lost_a_reply_to_the_round_timeout_failed_in_any_round(tmp_path, capsys):
    """The machine stalled (a benchmark paused while a test suite ran lost 3 evaluations to
    the round-timeout), not the method: not stored, even where divergence is a result, and
    tried again by the next invocation; a run that also diverged is no result either."""
    for index, results in enumerate((_rounds(10, {2: [LATE, LATE]}),
                                     _rounds(10, {4: [LATE], 9: [NAN]}))):
        runner = WritingRunner(results)
        store = RunStore(app_defaults(ROOT), REGISTRY, runner)
        record = tmp_path / f"late{index}.json"
        assert store.get(record, config(tmp_path), name="late", diverged_is_result=True) is None
        assert not record.exists()
        first = min(r["round"] for r in results["rounds"] if r.get("dropped"))
        assert store.failed[0].endswith(f"round {first}: {1 if index else 2} reply(ies) lost "
                                        f"({LATE['reason']})")
        assert ("not finite" in store.failed[0]) is bool(index)  # it diverged too: both said
        assert "late: run failed (round" in capsys.readouterr().err
        store.get(record, config(tmp_path), name="late")
        assert runner.calls == 2
    # a run that did not end (its heartbeat lost in the same stall) says both
    stalled = {**_rounds(3, {3: [LATE]}), "status": "running",
               "reason": "No heartbeat received from the task"}
    store = RunStore(app_defaults(ROOT), REGISTRY, WritingRunner(stalled, ok=False))
    assert store.get(tmp_path / "stalled.json", config(tmp_path), name="s") is None
    assert store.failed == [f"s: No heartbeat received from the task; round 3: 1 reply(ies) "
                            f"lost ({LATE['reason']})"]


def test_the_clients_lost_are_counted_over_the_window_and_by_stage():
    """The server's warning under its final accuracy reads the last evaluated round, one
    stage at a time: evaluation drops take a client out of the figure, training drops only
    out of the model; rounds without an evaluation (the tail after the last one) count."""
    eval_nan = {"stage": "evaluate", "client": "5", "reason": "metric 'loss' is not finite"}
    rounds = _rounds(4, {3: [NAN], 4: [NAN_ARRAY, eval_nan, LATE]})["rounds"]
    assert lost_to_non_finite(rounds, 1, stage="evaluate") == (
        "round 4: the replies of 1 client(s) were not finite (metric 'loss' is not finite)")
    assert lost_to_non_finite(rounds, 1, stage="train") == (
        "round 4: the replies of 1 client(s) were not finite ('w' has values that are not "
        "finite)")
    assert lost_to_non_finite(rounds, 2).startswith("rounds 3-4: the replies of 3 client(s)")
    tail = [*rounds, {"round": 5, "dropped": [NAN]}]  # round 5 trained, never evaluated
    assert lost_to_non_finite(tail, 1, stage="train").startswith(
        "rounds 4-5: the replies of 2 client(s)")
    assert lost_to_non_finite(_rounds(4, {3: [NAN]})["rounds"], 1) is None
    assert lost_to_non_finite([{"round": 1, "dropped": [NAN]}], 5) is None  # none evaluated
    with pytest.raises(ValueError, match="at least 1"):
        lost_to_non_finite(rounds, 0)


class DyingRunner:
    """A run that dies before writing results.json (a timeout, a crash), its folder holding
    the results.json of the run before it."""

    def __call__(self, run_config: dict[str, Any], context: dict[str, Any]) -> Ended:
        return Ended(False, "finished:failed", "timed out")


def test_a_run_that_died_is_never_read_as_the_run_before_it(tmp_path):
    """The folder's earlier results.json (a run that lost a client to NaN, say) is not this
    run's: a crash or a timeout is a failure, never stored, even where divergence is one."""
    before = tmp_path / "run" / "results.json"
    before.parent.mkdir()
    before.write_text(json.dumps({"status": "failed", "reason": "round 9: metric 'loss' is "
                                  "not finite", "final": {"privacy": {"epsilon": 9.0}}}))
    store = RunStore(app_defaults(ROOT), REGISTRY, DyingRunner())
    record = tmp_path / "died.json"
    assert store.get(record, config(tmp_path), name="died", diverged_is_result=True) is None
    assert store.failed == ["died: timed out"] and not record.exists()
    assert not before.exists()


def test_without_a_runner_or_leave_to_run_nothing_runs(tmp_path):
    runner = WritingRunner(RESULTS)
    assert RunStore(app_defaults(ROOT), REGISTRY).get(
        tmp_path / "r.json", config(tmp_path), name="r") is None
    assert RunStore(app_defaults(ROOT), REGISTRY, runner).get(
        tmp_path / "r.json", config(tmp_path), name="r", may_run=False) is None
    assert runner.calls == 0 and not (tmp_path / "r.json").exists()
