"""results.json as the ServerApp writes it (``server_app/results.py: ResultsRecorder``,
contracts §4): each round's entry with its own wall time, the final figures of the last
round evaluated and the run's totals, the budget a DP run spent, the method's
after-training results, the status and reason of a completed or failed run, and every
round sent to the trackers. The rounds come from a scripted engine's records; a real run
writes them in test_simulation.py."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from common.record import RoundRecord
from server_app import results
from server_app.results import ResultsRecorder
from server_app.tracking import Tracking
from strategies.registry import load_settings
from tests.conftest import app_config

EARLY = {"accuracy_weighted": 0.5, "accuracy_mean": 0.4, "accuracy_std": 0.1,
         "accuracy_min": 0.2, "accuracy_task_mean": 0.45, "per_client": {"0": 0.5}}
LATE = {"accuracy_weighted": 0.8, "accuracy_mean": 0.7, "accuracy_std": 0.05,
        "accuracy_min": 0.6, "accuracy_task_mean": 0.75, "per_client": {"0": 0.8}}


def _spent(epsilon: float) -> dict[str, Any]:
    return {"mode": "central", "epsilon": epsilon, "delta": 1e-5, "noise_multiplier": 1.0,
            "clip_norm": 1.0, "clipped_fraction": 0.5}


class _Rounds:
    """The engine's face to the recorder: round 1 evaluated, round 2 not (every evaluation
    reply dropped), round 3 evaluated; bytes up 10/20/30 and down 5 a round; a DP budget
    of 1, 2 and 3 spent."""

    def round_record(self, server_round: int) -> RoundRecord:
        evaluated = {1: EARLY, 3: LATE}.get(server_round)
        dropped = ([] if evaluated else
                   [{"stage": "evaluate", "node": n, "client": str(n), "reason": reason}
                    for n, reason in ((1, "no reply"), (2, "bad accuracy"))])
        return RoundRecord(bytes_up=10 * server_round, bytes_down_train=5, eval=evaluated,
                           dropped=dropped, extra={"privacy": _spent(server_round)})

    def server_state(self) -> dict[str, Any]:
        return {"split": [1, 0]}


class _Probe:
    """A tracker that remembers what it was sent."""

    OUTPUTS = ("probe/",)

    def __init__(self) -> None:
        self.rounds: list[int] = []
        self.closed: dict[str, Any] | None = None

    def log_round(self, entry: dict[str, Any]) -> None:
        self.rounds.append(entry["round"])

    def close(self, payload: dict[str, Any]) -> None:
        self.closed = payload


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The recorder's clock, set by the test (``time.monotonic`` itself, for the test's
    length: results.py reads it through the module)."""
    now = [100.0]
    monkeypatch.setattr(results.time, "monotonic", lambda: now[0])
    return now


def _recorder(tmp_path, **overrides) -> tuple[ResultsRecorder, _Probe]:
    settings = load_settings(app_config(plot=False, **overrides))
    tracking = Tracking([], tmp_path, {})
    probe = tracking.trackers["probe"] = _Probe()
    return ResultsRecorder(settings, _Rounds(), tmp_path, tracking), probe


def _written(recorder: ResultsRecorder) -> dict[str, Any]:
    return json.loads(recorder.path.read_text())


def test_a_completed_run_writes_each_round_and_the_last_evaluations_figures(
        tmp_path, clock, caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    recorder, probe = _recorder(tmp_path)
    recorder.start()
    assert _written(recorder)["status"] == "running" and _written(recorder)["rounds"] == []
    for server_round, now in ((1, 103.0), (2, 108.0), (3, 110.0)):
        clock[0] = now
        recorder.on_round(server_round)
    recorder.finish({"new_clients": {"9": 0.7}}, reason="round 4 would pass dp.target-epsilon")
    written = _written(recorder)
    assert [(r["round"], r["seconds"]) for r in written["rounds"]] == [(1, 3), (2, 5), (3, 2)]
    assert written["final"] == {
        "accuracy_weighted": 0.8, "accuracy_mean": 0.7, "accuracy_std": 0.05,
        "accuracy_min": 0.6, "accuracy_task_mean": 0.75, "bytes_up_total": 60,
        "bytes_down_total": 15, "seconds_total": 10, "privacy": _spent(3)}
    assert (written["status"], written["reason"]) == (
        "completed", "round 4 would pass dp.target-epsilon")
    assert written["new_clients"] == {"9": 0.7} and written["server_state"] == {"split": [1, 0]}
    assert written["evaluated_on"] == "test" and written["method"] == "fedavg"
    assert probe.rounds == [1, 2, 3] and probe.closed["status"] == "completed"
    assert "| epsilon 3.000 at delta 1e-05 (central DP)" in caplog.text
    assert f"[final] wrote to {tmp_path}: results.json" in caplog.text


def test_a_failed_run_keeps_its_rounds_through_the_one_that_failed(tmp_path, clock):
    recorder, probe = _recorder(tmp_path)
    recorder.start()
    recorder.on_round(1)
    recorder.fail("training of round 3: all 2 clients that replied failed: OSError", 3)
    written = _written(recorder)
    assert [r["round"] for r in written["rounds"]] == [1, 2, 3]
    assert (written["status"], written["reason"]) == (
        "failed", "training of round 3: all 2 clients that replied failed: OSError")
    assert probe.rounds == [1, 2, 3] and probe.closed["status"] == "failed"


def test_a_run_whose_last_round_has_no_accuracy_says_why(tmp_path, clock):
    recorder, _ = _recorder(tmp_path)
    recorder.on_round(1)
    assert recorder.missing_evaluation() is None
    recorder.on_round(2)
    assert recorder.missing_evaluation() == ("round 2: no client's evaluation arrived "
                                             "(2 dropped: bad accuracy; no reply)")
    quiet, _ = _recorder(tmp_path / "quiet", **{"fraction-evaluate": 0.0})
    quiet.on_round(2)
    assert quiet.missing_evaluation() is None  # it asked for none


def test_a_tuning_run_says_it_was_scored_on_validation_splits(tmp_path, clock):
    recorder, _ = _recorder(tmp_path, **{"validation-fraction": 0.2})
    recorder.start()
    assert _written(recorder)["evaluated_on"] == "validation"


def test_a_round_written_before_its_evaluation_keeps_one_entry(tmp_path, clock):
    """A round ``evaluate-every`` skipped, then evaluated as the run's last (a DP budget stop
    after it): its entry is replaced by the one with the evaluation, its times added."""
    recorder, probe = _recorder(tmp_path)
    recorder.start()
    clock[0] = 102.0
    recorder.on_round(2)
    clock[0] = 103.5
    recorder.on_round(2)
    (entry,) = _written(recorder)["rounds"]
    assert entry["round"] == 2 and entry["seconds"] == 3.5 and probe.rounds == [2, 2]
