"""Shared fixtures: a private Flower SuperLink for the integration tests, and schema checks."""

from __future__ import annotations

import json
import shutil
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from common.local_federation import LocalFederation

ROOT = Path(__file__).resolve().parents[1]
APP_PACKAGES = ["server_app", "client_app", "strategies", "models", "fldata", "common"]


def app_config(**overrides: Any) -> dict[str, Any]:
    """The app's run config as Flower builds it: pyproject defaults plus overrides."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {**pyproject["tool"]["flwr"]["app"]["config"], **overrides}


@pytest.fixture(scope="session")
def federation():
    """One private simulation SuperLink for the whole session, stopped at the end."""
    with LocalFederation() as fed:
        yield fed


def copy_app(dest: Path) -> Path:
    """A copy of the Flower app (what ``flwr run`` bundles) that a test may modify."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    for package in APP_PACKAGES:
        shutil.copytree(ROOT / package, dest / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def check_results_schema(results: dict[str, Any], method: str, num_rounds: int,
                         num_clients: int) -> None:
    """Contracts §4 (docs/contracts.md), field by field."""
    assert results["method"] == method
    assert results["config"]["method"] == method
    assert [r["round"] for r in results["rounds"]] == list(range(1, num_rounds + 1))
    for entry in results["rounds"]:
        assert entry["seconds"] > 0
        assert isinstance(entry["bytes_up"], int) and entry["bytes_up"] >= 0
        assert isinstance(entry["bytes_down"], int) and entry["bytes_down"] >= 0
        assert set(entry["train"]) >= {"loss", "num_clients"}
        evaluation = entry["eval"]
        assert set(evaluation) >= {"accuracy_weighted", "accuracy_mean", "accuracy_std",
                                   "accuracy_min", "num_clients", "per_client"}
        assert evaluation["num_clients"] == num_clients
        assert sorted(evaluation["per_client"]) == sorted(str(i) for i in range(num_clients))
        for key in ("accuracy_weighted", "accuracy_mean", "accuracy_min"):
            assert 0.0 <= evaluation[key] <= 1.0
        assert evaluation["accuracy_min"] == min(evaluation["per_client"].values())
        # every client's handler and the server's strategy work took some CPU time
        assert set(entry["cpu_seconds"]) == {"clients_train", "clients_evaluate", "server"}
        assert all(v > 0 for v in entry["cpu_seconds"].values())
    final = results["final"]
    for key in ("accuracy_weighted", "accuracy_mean", "accuracy_std", "bytes_up_total",
                "bytes_down_total", "seconds_total"):
        assert key in final
    assert final["accuracy_weighted"] == results["rounds"][-1]["eval"]["accuracy_weighted"]
    assert final["bytes_up_total"] == sum(r["bytes_up"] for r in results["rounds"])


def read_results(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "results.json").read_text())


def wait_for(predicate, timeout: float, poll: float = 1.0) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll)


def run_in_background(federation: Any, config: dict) -> tuple[threading.Thread, dict]:
    """``federation.run(ROOT, config)`` in a thread; its FlowerRun lands in ``result["run"]``
    once the thread is joined."""
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(run=federation.run(ROOT, config)))
    runner.start()
    return runner, result
