"""Experiment tracking (server_app/tracking.py). What a real run writes is read back in
tests/test_compare.py, whose comparison runs with both trackers on."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.config import ConfigError
from server_app import tracking
from server_app.tracking import Tracking
from strategies.registry import load_settings
from tests.conftest import app_config

ROUND = {"round": 3, "seconds": 1.5, "bytes_up": 100, "bytes_down": 200,
         "train": {"loss": 0.7, "num_clients": 2},
         "eval": {"accuracy_weighted": 0.8, "accuracy_mean": 0.75, "accuracy_std": 0.05,
                  "accuracy_min": 0.7, "num_clients": 2, "per_client": {"0": 0.7, "1": 0.8}}}


def test_tracking_names_are_checked_with_one_line():
    assert load_settings(app_config(tracking="mlflow, tensorboard")).trackers() == [
        "mlflow", "tensorboard"]
    assert load_settings(app_config()).trackers() == []
    with pytest.raises(ConfigError, match=r"^tracking: unknown value 'wandb'; allowed: "
                                          r"tensorboard, mlflow$"):
        load_settings(app_config(tracking="tensorboard,wandb"))


def test_a_tracker_whose_package_is_missing_stops_with_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(tracking.REQUIREMENTS, "mlflow", ("no_such_module_xyz", "mlflow"))
    with pytest.raises(ConfigError) as raised:
        Tracking(["tensorboard", "mlflow"], tmp_path, {})
    assert str(raised.value) == ("tracking: mlflow not installed where the ServerApp "
                                 "runs; install the extra: pip install -e '.[tracking]'")
    assert not (tmp_path / "tensorboard").exists()  # nothing started


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_others_go_on(tmp_path, caplog):
    class FullDisk:
        def log_round(self, entry):
            raise OSError(28, "No space left on device")

        def close(self, payload):
            raise AssertionError("a dropped tracker is not called again")

    run = Tracking(["tensorboard"], tmp_path, {"method": "fedavg"})
    run.trackers = {"broken": FullDisk(), **run.trackers}
    run.log_round(ROUND)
    run.log_round({**ROUND, "round": 4})
    run.close({"status": "completed"})
    assert "[tracking] broken stopped: OSError" in caplog.text
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("accuracy/weighted")] == [3, 4]
    assert events.Scalars("loss/train")[0].value == pytest.approx(0.7)
    assert events.Scalars("bytes/down")[0].value == 200


def test_a_tracker_that_cannot_start_stops_the_run_with_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # the output-dir's place is taken by a file
    with pytest.raises(ConfigError, match=r"^tracking: mlflow could not start in "):
        Tracking(["mlflow"], Path(blocked), {})
