"""On a machine with a CUDA device (skipped elsewhere, CI included): every method's clients
train and evaluate on the GPU in a real deployment (``flower-superlink`` plus two
``flower-supernode`` processes, each ClientApp a process of its own), and simulated clients
(Ray) on their share of the GPU (``client-resources-num-gpus``).

``device = "cuda"`` makes a client refuse to start without a visible CUDA device, so a run that
completes with it trained every client there; the personal state written to each site's state
directory must load on a machine without one (tensors saved from the CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench.evidence import protocol
from bench.evidence.cells import Matrix, run, select
from launch.deployment import LocalDeployment
from launch.federation import LocalFederation
from strategies.registry import REGISTRY
from tests.conftest import read_results

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]
ROOT = Path(__file__).resolve().parents[1]
# two local epochs: FedRep's and FedDecomp's two phases both run each round
CONFIG = {"device": "cuda", "num-server-rounds": 2, "local-epochs": 2, "min-nodes": 2,
          "plot": False, "round-timeout": 300.0}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    with LocalDeployment(2, home=tmp_path_factory.mktemp("home"), database=None) as running:
        yield running


# DP's clipping and noise on CUDA tensors: the server's (central) and the client's (local);
# a small noise, as the path is tested here, not privacy
PRIVATE = {"dp.noise-multiplier": 0.001, "dp.clip-norm": 5.0}
RUNS = ([(method, {}) for method in sorted(REGISTRY)]
        + [("feddecomp", {"dp.mode": "central", **PRIVATE}),
           ("fedper", {"dp.mode": "local", **PRIVATE})])


@pytest.mark.parametrize(("method", "extra"), RUNS,
                         ids=[m + "".join(f"-{v}" for k, v in e.items() if k == "dp.mode")
                              for m, e in RUNS])
def test_every_method_trains_its_clients_on_the_gpu(deployment, method, extra, tmp_path):
    out = tmp_path / "out"
    run = deployment.run(ROOT, {**CONFIG, "method": method, "output-dir": str(out), **extra})
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    final = results["final"]
    assert sorted(results["rounds"][-1]["eval"]["per_client"]) == ["site-0", "site-1"]
    assert math.isfinite(final["accuracy_weighted"]) and final["accuracy_weighted"] > 0.3
    if extra:
        assert final["privacy"]["epsilon"] > 0
    for site in range(2):  # loaded as saved (no map_location): a CUDA tensor comes back on CUDA
        saved = torch.load(deployment.state_dir(site) / f"site-{site}.pt", weights_only=True)
        assert saved["method"] == method
        assert {t.device.type for t in saved["personal"].values()} <= {"cpu"}


@pytest.fixture(scope="module")
def cold_federation(tmp_path_factory):
    """A private Ray instance sized by this machine: the suite's warm ``federation`` offers one
    CPU, so its four clients would take turns in one actor."""
    with LocalFederation(home=tmp_path_factory.mktemp("flwr")) as running:
        yield running


@pytest.mark.parametrize(("method", "extra"), [("fedfac", {}),
                                               ("feddecomp", {"dp.mode": "central", **PRIVATE})],
                         ids=["fedfac", "feddecomp-central"])
def test_simulated_clients_train_on_their_share_of_the_gpu(cold_federation, method, extra,
                                                           tmp_path):
    out = tmp_path / "out"
    run = cold_federation.run(ROOT, {**CONFIG, "method": method, "output-dir": str(out),
                                     **extra}, num_supernodes=4, gpus_per_client=0.25)
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    final = results["final"]
    assert len(results["rounds"][-1]["eval"]["per_client"]) == 4
    assert math.isfinite(final["accuracy_weighted"]) and final["accuracy_weighted"] > 0.3
    if extra:
        assert final["privacy"]["epsilon"] > 0


def test_matrix_cells_on_the_gpu_train_each_client_on_its_share(cold_federation, tmp_path,
                                                                monkeypatch):
    """``bench/matrix.py --device cuda``: each simulated client gets a share of the GPU (else
    Ray hides it and the client refuses ``device=cuda``), and the cells are kept apart from
    the CPU's."""
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1,))
    monkeypatch.setattr(protocol, "MAX_DOUBLINGS", 0)
    common = {"dataset": "digits", "num-server-rounds": 2, "local-epochs": 1, "plot": False,
              "device": "cuda"}
    matrix = Matrix(cold_federation, common, tmp_path, num_clients=3)
    run(matrix, select(["dirichlet-0.1"], ["fedavg"]), "report")
    [path] = (tmp_path / "matrix" / "cells-cuda").rglob("*.json")
    cell = json.loads(path.read_text())
    assert f"device cuda ({torch.cuda.get_device_name(0)})" in cell["machine"]
    assert len(cell["rounds"]) == 2
    assert math.isfinite(cell["accuracy_weighted"]) and cell["accuracy_weighted"] > 0.3
    assert not (tmp_path / "matrix" / "cells").exists()
