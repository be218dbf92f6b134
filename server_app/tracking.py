"""Experiment tracking (``tracking`` key): each round's numbers, the run config and the
per-client accuracies, to TensorBoard and to MLflow, written under the run's output-dir.

What is logged, at the step of the round it belongs to (``docs/tracking.md``):
``accuracy/weighted``, ``accuracy/mean``, ``accuracy/std``, ``accuracy/min``,
``accuracy/task_mean``, ``loss/train``, ``bytes/up``, ``bytes/down`` and
``time/round_seconds``; the distribution of the clients' accuracies (a TensorBoard
histogram ``accuracy/per_client``, an MLflow artifact ``per_client/round-NNNN.json``); the
run config (TensorBoard text ``config``, MLflow params) once; and, for MLflow, results.json
as an artifact and the run's status when it ends.

TensorBoard writes event files to ``<output-dir>/tensorboard``. MLflow writes to an SQLite
store, ``<output-dir>/mlflow.db`` (no server; MLflow 3 refuses its old file store unless told
otherwise), artifacts under ``<output-dir>/mlartifacts``.

A tracker is a side channel: one that fails during the run (a full disk) is dropped with a
warning, and the run and its results.json go on. One that cannot start (its package missing)
stops the run before round 1 with one line.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
import warnings
from logging import WARNING
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from flwr.common.logger import log

from common.config import TRACKERS, ConfigError

# tracker name -> (the module it needs, the package that provides it)
REQUIREMENTS = {"tensorboard": ("tensorboard", "tensorboard"),
                "mlflow": ("mlflow", "mlflow")}


def check_installed(names: list[str]) -> None:
    """One line naming what to install when a chosen tracker's package is missing."""
    missing = [package for name in names
               for module, package in [REQUIREMENTS[name]]
               if importlib.util.find_spec(module) is None]
    if missing:
        # the Python that lacks them, named: a bare pip can be another one's (the system's)
        raise ConfigError(f"tracking: {' and '.join(missing)} not installed where the "
                          f"ServerApp runs; install the extra: {sys.executable} -m pip "
                          "install -e '.[tracking]'")


def round_metrics(entry: dict[str, Any]) -> dict[str, float]:
    """The scalars of one round of results.json, by tracking name."""
    evaluated = entry.get("eval", {})
    metrics = {f"accuracy/{stat}": evaluated[f"accuracy_{stat}"]
               for stat in ("weighted", "mean", "std", "min", "task_mean")
               if f"accuracy_{stat}" in evaluated}
    if "loss" in entry.get("train", {}):
        metrics["loss/train"] = entry["train"]["loss"]
    metrics |= {"bytes/up": entry["bytes_up"], "bytes/down": entry["bytes_down"],
                "time/round_seconds": entry["seconds"]}
    spent = entry.get("privacy", {})
    metrics |= {f"privacy/{name}": spent[name] for name in ("epsilon", "clip_norm",
                                                            "clipped_fraction")
                if spent.get(name) is not None}
    return {k: float(v) for k, v in metrics.items()}


class Tracker(Protocol):
    OUTPUTS: tuple[str, ...]  # what it writes under the output-dir (a folder ends in /)

    def log_round(self, entry: dict[str, Any]) -> None: ...
    def close(self, payload: dict[str, Any]) -> None: ...


class TensorBoardTracker:
    OUTPUTS = ("tensorboard/",)

    def __init__(self, out_dir: Path, run_config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        rows = "\n".join(f"| {k} | {v} |" for k, v in sorted(run_config.items()))
        self.writer.add_text("config", f"| key | value |\n|---|---|\n{rows}")

    def log_round(self, entry: dict[str, Any]) -> None:
        step = entry["round"]
        for name, value in round_metrics(entry).items():
            self.writer.add_scalar(name, value, step)
        per_client = entry.get("eval", {}).get("per_client")
        if per_client:
            self.writer.add_histogram("accuracy/per_client",
                                      np.array(list(per_client.values())), step)
        self.writer.flush()  # a live TensorBoard shows the round now, not in 2 minutes

    def close(self, payload: dict[str, Any]) -> None:
        self.writer.close()


class MlflowTracker:
    EXPERIMENT = "pflower"
    OUTPUTS = ("mlflow.db", "mlartifacts/")

    def __init__(self, out_dir: Path, run_config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        # its schema migrations log at INFO, once per new store; its SQLAlchemy calls warn
        # of their own deprecations
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(WARNING)
        warnings.filterwarnings("ignore", module=r"mlflow\.")
        self.client = MlflowClient(tracking_uri=f"sqlite:///{out_dir.resolve() / 'mlflow.db'}")
        found = self.client.get_experiment_by_name(self.EXPERIMENT)
        experiment = found.experiment_id if found else self.client.create_experiment(
            self.EXPERIMENT, artifact_location=(out_dir.resolve() / "mlartifacts").as_uri())
        name = f"{run_config.get('method')}-seed{run_config.get('seed')}"
        self.run_id = self.client.create_run(experiment, run_name=name).info.run_id
        params = [Param(k, str(v)) for k, v in sorted(run_config.items())]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def log_round(self, entry: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, stamp = entry["round"], int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[
            Metric(name, value, stamp, step) for name, value in round_metrics(entry).items()])
        per_client = entry.get("eval", {}).get("per_client")
        if per_client:
            self.client.log_dict(self.run_id, per_client, f"per_client/round-{step:04d}.json")

    def close(self, payload: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, payload, "results.json")
        self.client.set_terminated(
            self.run_id, "FINISHED" if payload["status"] == "completed" else "FAILED")


TRACKER_CLASSES = {"tensorboard": TensorBoardTracker, "mlflow": MlflowTracker}
# the names the run config accepts (common.config) are the ones implemented here
assert set(TRACKER_CLASSES) == set(REQUIREMENTS) == set(TRACKERS)


class Tracking:
    """The run's trackers; each call goes to every tracker still working."""

    def __init__(self, names: list[str], out_dir: Path, run_config: dict[str, Any]) -> None:
        check_installed(names)
        self.trackers: dict[str, Tracker] = {}
        self.outputs: list[str] = []  # what the trackers write under out_dir
        for name in names:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
                self.trackers[name] = TRACKER_CLASSES[name](out_dir, run_config)
                self.outputs.extend(TRACKER_CLASSES[name].OUTPUTS)
            except Exception as error:
                raise ConfigError(f"tracking: {name} could not start in {out_dir}: "
                                  f"{type(error).__name__}: {error}") from None

    def log_round(self, entry: dict[str, Any]) -> None:
        self._each("log_round", entry)

    def close(self, payload: dict[str, Any]) -> None:
        self._each("close", payload)
        self.trackers.clear()

    def _each(self, call: str, argument: dict[str, Any]) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, call)(argument)
            except Exception as error:  # a side channel: results.json is what the run owes
                log(WARNING, "[tracking] %s stopped: %s: %s (results.json goes on)", name,
                    type(error).__name__, error)
                del self.trackers[name]
