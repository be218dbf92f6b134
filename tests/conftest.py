"""Shared fixtures: a private Flower SuperLink for the integration tests, and schema checks."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from launch.app_project import app_defaults, app_packages
from launch.federation import FlowerRun, LocalFederation, warm_federation
from launch.warm_start import ForkServer
from tests.grouping import pytest_collection_modifyitems  # noqa: F401 (a pytest hook)

# One PyTorch thread in each pytest worker, unless OMP_NUM_THREADS says otherwise: the
# workers train models in-process side by side on the machine's few cores, and PyTorch's
# default (a thread per core in each) oversubscribes them; OpenMP's waiting threads then spin
# on CPU the others need. The unit tier on 2 idle cores, 3 workers: 228 s of CPU and 1 min
# 52 s with the default; 173-189 s and 1 min 25 s-1 min 37 s with one thread. The
# federations' processes keep their own settings (with OMP_NUM_THREADS=1 exported to them,
# three simulation test files gained nothing: 599 s of CPU against 565 s).
if not os.environ.get("OMP_NUM_THREADS"):
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
APP_PACKAGES = app_packages(ROOT)
# A user's own model module (tests/user_code/user_models.py): importable by the tests
# (pyproject's pytest pythonpath) and by the federation's processes (its PYTHONPATH)
USER_CODE = ROOT / "tests" / "user_code"


def app_config(**overrides: Any) -> dict[str, Any]:
    """The app's run config as Flower builds it: pyproject defaults plus overrides."""
    return {**app_defaults(ROOT), **overrides}


@pytest.fixture
def server_task():
    """Messages are made by a running ServerApp: Flower reads its run and node id."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def make_client(partition: int, run_config: dict[str, Any], **node: Any):
    """A ClientApp ``Client`` of partition ``partition`` of 4 (node id 100 + partition), with
    ``node`` added to its node config."""
    from flwr.app import Context, RecordDict

    from client_app.runtime import Client

    return Client.from_context(Context(
        run_id=1, node_id=100 + partition,
        node_config={"partition-id": partition, "num-partitions": 4, **node},
        state=RecordDict(), run_config=run_config))


@pytest.fixture(scope="session")
def forkserver():
    """One fork server for the session (of each pytest worker): the simulations'
    flwr-simulation and the deployments' flwr-clientapp processes start warm from it."""
    with ForkServer() as forks:
        yield forks


@pytest.fixture(scope="session")
def federation(forkserver):
    """One private simulation SuperLink for the whole session (of each pytest worker), its
    runs on one Ray head kept up between them and their flwr-simulation processes forked
    warm (warm runs); all stopped at the end. The suite is bound by CPU, so: the head offers
    one CPU, and each run's clients take turns in one ClientApp actor (the tests' runs are a
    few seconds of training; a second actor is a second worker importing PyTorch and Flower
    for every run: 6 rounds of 5 clients cost 10 s of CPU instead of 14-23 s); the SuperExec
    looks for a new run every second, not every 0.1 s (idle, 0.7 s of CPU a minute instead
    of 4.6 s), which starts each run up to a second later."""
    with warm_federation(pythonpath=[USER_CODE], forkserver=forkserver, ray_cpus=1,
                         superexec_poll_seconds=1.0) as fed:
        yield fed


# The reference run: the fewest rounds and clients in which round r's evaluation rides in round
# r+1's messages and one round follows another with state carried over; two local epochs, so
# that a two-phase local rule (FedRep, FedDecomp) runs both phases. Its model is a user's own
# (tests/user_code/user_models.py: layers registered out of forward order, BatchNorm), so that
# each reference run is also that method's run on a user's model. The default CNN runs for
# real in FedFac's, pFedC's and Factorized-FL's own tests, the deployment and compose tests
# (FedPer, Local) and the demo (FedAvg); every method makes a round trip on it in
# tests/test_wire.py.
USER_MODEL = "user_models:classifier_first"
REFERENCE = {"num-server-rounds": 3, "local-epochs": 2, "plot": False, "model": USER_MODEL}
REFERENCE_CLIENTS = 3


class SharedRuns:
    """Real runs shared among the tests that only read their results: one ``flwr run`` per
    distinct run config and federation size, made when a test first asks for it.

    With several pytest workers the tests that use it run in one (``tests/grouping.py``), so
    each run is still made once."""

    def __init__(self, federation: LocalFederation, directory: Path) -> None:
        self.federation, self.directory = federation, directory
        self._runs: dict[str, tuple[FlowerRun, Path]] = {}

    def get(self, config: dict[str, Any], num_supernodes: int = REFERENCE_CLIENTS
            ) -> tuple[FlowerRun, Path]:
        """The run of ``config`` (no ``output-dir``: each run gets its own) and its output
        folder; ``run.ok`` is for the caller to assert."""
        key = json.dumps([config, num_supernodes], sort_keys=True)
        if key not in self._runs:
            out = self.directory / f"run-{len(self._runs)}"
            run = self.federation.run(ROOT, {**config, "output-dir": str(out)},
                                      num_supernodes=num_supernodes)
            self._runs[key] = (run, out)
        return self._runs[key]

    def reference(self, method: str, **overrides: Any) -> tuple[FlowerRun, dict[str, Any]]:
        """The reference run of ``method`` (``REFERENCE``, ``REFERENCE_CLIENTS`` clients)
        with ``overrides``: the run, checked to have completed, and its results."""
        run, out = self.get({**REFERENCE, "method": method, **overrides})
        assert run.ok, run.output[-3000:]
        return run, read_results(out)


@pytest.fixture(scope="session")
def shared_runs(federation, tmp_path_factory) -> SharedRuns:
    return SharedRuns(federation, tmp_path_factory.mktemp("shared-runs"))


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
    # under local DP the clients withhold their losses and timings (docs/privacy.md)
    local_dp = results["config"].get("dp.mode") == "local"
    for entry in results["rounds"]:
        assert entry["seconds"] > 0
        assert isinstance(entry["bytes_up"], int) and entry["bytes_up"] >= 0
        assert isinstance(entry["bytes_down"], int) and entry["bytes_down"] >= 0
        assert set(entry["train"]) >= ({"num_clients"} if local_dp else {"loss", "num_clients"})
        evaluation = entry["eval"]
        assert set(evaluation) >= {"accuracy_weighted", "accuracy_mean", "accuracy_std",
                                   "accuracy_min", "num_clients", "per_client"}
        assert evaluation["num_clients"] == num_clients
        assert sorted(evaluation["per_client"]) == sorted(str(i) for i in range(num_clients))
        for key in ("accuracy_weighted", "accuracy_mean", "accuracy_min"):
            assert 0.0 <= evaluation[key] <= 1.0
        assert evaluation["accuracy_min"] == min(evaluation["per_client"].values())
        # every client sent its task accuracy (docs/results.md#task-accuracy)
        assert 0.0 <= evaluation["accuracy_task_mean"] <= 1.0
        assert "accuracy_task_num_clients" not in evaluation
        # every client's handler and the server's strategy work took some CPU time
        assert set(entry["cpu_seconds"]) == {"clients_train", "clients_evaluate", "server"}
        assert all(v > 0 for name, v in entry["cpu_seconds"].items()
                   if not (local_dp and name.startswith("clients")))
    final = results["final"]
    for key in ("accuracy_weighted", "accuracy_mean", "accuracy_std", "bytes_up_total",
                "bytes_down_total", "seconds_total"):
        assert key in final
    assert final["accuracy_weighted"] == results["rounds"][-1]["eval"]["accuracy_weighted"]
    assert final["accuracy_task_mean"] == results["rounds"][-1]["eval"]["accuracy_task_mean"]
    assert final["bytes_up_total"] == sum(r["bytes_up"] for r in results["rounds"])


class EpochSnapshots:
    """A training loader that records the model's parameters each time an epoch starts (a
    local rule's phases are whole epochs, so this shows what each phase moved)."""

    def __init__(self, loader, model) -> None:
        self.loader, self.model, self.snapshots = loader, model, []

    def __iter__(self):
        self.snapshots.append({k: v.detach().clone() for k, v in
                               self.model.named_parameters()})
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def moved(before: dict, after: dict) -> set[str]:
    """Names whose tensors differ between two parameter snapshots."""
    return {k for k in before if not torch.equal(before[k], after[k])}


def moves_per_epoch(client) -> tuple[list[set[str]], set[str]]:
    """Run ``client``'s local rule once from the initial shared arrays: per epoch the names of
    the parameters that moved, and the names of all parameters."""
    from strategies.registry import initial_state
    from strategies.training import LocalTraining

    model = client.model(initial_state(client.settings).arrays)
    loader = EpochSnapshots(client.loader(True, 1), model)
    torch.manual_seed(1)
    client.method.local_train(LocalTraining(model, loader, client.settings, client.device, 1))
    snapshots = [*loader.snapshots, dict(model.named_parameters())]
    return [moved(a, b) for a, b in itertools.pairwise(snapshots)], set(snapshots[0])


def read_results(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "results.json").read_text())


def read_mlflow_run(out_dir: Path) -> tuple[Any, Any, Path]:
    """The one MLflow run that a run with ``tracking`` mlflow wrote under ``out_dir``
    (``server_app/tracking.py``): the client on its store, the run, its artifacts folder."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("pflower").experiment_id])
    return client, run, Path(run.info.artifact_uri.removeprefix("file://"))


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
