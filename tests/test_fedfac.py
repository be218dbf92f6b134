"""FedFac: factor analysis, quantile split, static split on the wire, FedAvg equivalence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from client_app.runtime import Client
from common.config import ConfigError
from common.protocol import ClientReply
from models.fedfac import analysed_layers, element_keys
from server_app.app import initial_shared_arrays
from strategies.fedfac.server import (
    FedFacStrategy,
    factor_count,
    principal_axis_loadings,
    shared_elements,
)
from strategies.fedfac.spec import MASK_PREFIX
from strategies.personalized import PersonalizedStrategy
from strategies.registry import build_model, build_wire, load_settings
from strategies.training import LocalTraining
from tests.conftest import app_config, read_results

ROOT = Path(__file__).resolve().parents[1]


def known_loadings(num_shared: int = 6, num_personal: int = 10) -> np.ndarray:
    """Two factors, each loading strongly on half of the shared elements; the personal
    elements load weakly on both."""
    rng = np.random.default_rng(0)
    strong = np.zeros((num_shared, 2))
    half = num_shared // 2
    strong[:half, 0] = rng.uniform(0.8, 0.9, half)
    strong[half:, 1] = rng.uniform(0.8, 0.9, num_shared - half)
    weak = rng.uniform(0.0, 0.15, (num_personal, 2))
    return np.vstack([strong, weak])


def test_communalities_rank_truly_shared_elements_first():
    loadings = known_loadings()
    r = loadings @ loadings.T
    np.fill_diagonal(r, 1.0)
    estimated = principal_axis_loadings(r, 2)
    nu = (estimated**2).sum(axis=1)
    assert set(np.argsort(nu)[::-1][:6]) == set(range(6))
    true_nu = (loadings**2).sum(axis=1)
    np.testing.assert_allclose(nu, true_nu, atol=0.05)


def test_factor_count_follows_kappa():
    eigenvalues = np.array([5.0, 3.0, 1.0, 0.5, 0.5])   # total 10
    assert factor_count(eigenvalues, 0.5) == 1
    assert factor_count(eigenvalues, 0.8) == 2
    assert factor_count(eigenvalues, 0.85) == 3
    assert factor_count(eigenvalues, 1.0) == 5
    counts = [factor_count(eigenvalues, k) for k in np.linspace(0.1, 1.0, 10)]
    assert counts == sorted(counts)


def _sampled_weights(num_clients: int = 8, fan_in: int = 60) -> list[np.ndarray]:
    """Client weight matrices (elements x fan-in) whose elements follow known loadings."""
    loadings = known_loadings()
    rng = np.random.default_rng(1)
    weights = []
    for _ in range(num_clients):
        factors = rng.normal(size=(fan_in, 2))
        noise = rng.normal(size=(fan_in, len(loadings))) * np.sqrt(
            1 - (loadings**2).sum(axis=1))
        weights.append((factors @ loadings.T + noise).T)
    return weights


@pytest.mark.parametrize(("quantile", "expected"), [(0.5, 8), (0.75, 4), (0.25, 12)])
def test_quantile_threshold_gives_the_shared_fraction(quantile, expected):
    mask, nu, _ = shared_elements(_sampled_weights(), kappa=0.5, tau_quantile=quantile)
    assert mask.sum() == expected
    assert nu[mask].min() >= nu[~mask].max()


def test_sampled_weights_recover_the_shared_elements():
    mask, _, factors = shared_elements(_sampled_weights(), kappa=0.25, tau_quantile=10 / 16)
    assert set(np.flatnonzero(mask)) == set(range(6))
    assert factors == 2


def test_quantile_above_one_is_personal_below_zero_is_shared():
    assert not shared_elements(_sampled_weights(), 0.85, 1.5)[0].any()
    assert shared_elements(_sampled_weights(), 0.85, -0.5)[0].all()


def test_layer_selection_and_element_keys():
    model = build_model(load_settings(app_config(method="fedfac")))
    assert analysed_layers(model, "0") == ["body.0"]
    assert analysed_layers(model, "body.4, -1") == ["body.4", "head"]
    assert element_keys(model, "body.0") == ["body.0.weight", "body.1.weight", "body.1.bias",
                                             "body.1.running_mean", "body.1.running_var"]
    assert element_keys(model, "body.9") == ["body.9.weight", "body.9.bias"]
    with pytest.raises(ConfigError, match=r"fedfac\.layers"):
        load_settings(app_config(**{"method": "fedfac", "fedfac.layers": "9"}))


def _client(pid: int, **overrides) -> Client:
    return Client.from_context(Context(
        run_id=1, node_id=pid, node_config={"partition-id": pid, "num-partitions": 4},
        state=RecordDict(), run_config=app_config(**{"method": "fedfac", **overrides})))


def _reply(client: Client, received: ArrayRecord) -> ClientReply:
    model = client.model(received)
    torch.manual_seed(client.partition_id)
    client.method.local_train(LocalTraining(model, client.loader(True, 1), client.settings,
                                            client.device, 1))
    return ClientReply(client.partition_id, client.client_id,
                       client.shared_arrays(model, received),
                       MetricRecord({"num-examples": len(client.data.y_train)}),
                       ConfigRecord({"client-id": client.client_id}))


def test_all_shared_layer_equals_fedavg():
    overrides = {"fedfac.layers": "0,1", "fedfac.tau-quantile": -1.0}
    clients = [_client(pid, **overrides) for pid in range(3)]
    settings = clients[0].settings
    initial = initial_shared_arrays(settings)
    replies = [_reply(c, initial) for c in clients]
    wire = build_wire(settings)
    fedfac = FedFacStrategy(settings, initial, wire).aggregate_shared(1, replies, initial)
    fedavg = PersonalizedStrategy(settings, initial, wire).aggregate_shared(1, replies, initial)
    assert set(fedfac) == set(fedavg)
    for key in fedavg:
        np.testing.assert_allclose(fedfac[key].numpy(), fedavg[key].numpy(), rtol=1e-5,
                                   atol=1e-6)


def test_personal_rows_stay_on_the_client_and_shared_rows_come_from_the_server():
    client = _client(0)
    initial = initial_shared_arrays(client.settings)
    strategy = FedFacStrategy(client.settings, initial, client.wire)
    model = client.model(initial)
    with torch.no_grad():
        model.body[0].weight.add_(1.0)  # this client's own conv kernels
    client.keep_personal(model, initial, client.shared_arrays(model, initial))
    own = model.body[0].weight.detach().clone()
    strategy.split = {"body.0": np.arange(32) % 4 == 0}   # 8 shared channels
    down = strategy.downlink(2, "0", initial)
    assert down["body.0.weight"].shape[0] == 8 and f"{MASK_PREFIX}body.0" in down
    merged = client.model(down).body[0].weight.detach()
    mask = torch.from_numpy(strategy.split["body.0"])
    torch.testing.assert_close(merged[~mask], own[~mask])
    torch.testing.assert_close(merged[mask], torch.from_numpy(initial["body.0.weight"].numpy())[
        mask])
    sent = client.shared_arrays(client.model(down), down)
    assert sent["body.0.weight"].shape[0] == 8  # static: personal rows are not sent


def test_whole_layer_personal_sends_no_rows():
    client = _client(0, **{"fedfac.tau-quantile": 2.0})
    initial = initial_shared_arrays(client.settings)
    strategy = FedFacStrategy(client.settings, initial, client.wire)
    strategy.aggregate_shared(1, [_reply(client, initial), _reply(_client(1), initial)],
                              initial)
    assert not strategy.split["body.0"].any()
    down = strategy.downlink(2, "0", initial)
    assert down["body.0.weight"].shape[0] == 0


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_real_rounds_split_on_the_wire(federation, tmp_path, mode):
    run = federation.run(ROOT, {"method": "fedfac", "fedfac.mode": mode,
                                "fedfac.layers": "0,1", "fedfac.tau-quantile": 0.5,
                                "num-server-rounds": 3, "local-epochs": 1, "plot": False,
                                "fedfac.new-clients": 0.25, "output-dir": str(tmp_path)},
                       num_supernodes=4)
    assert run.ok, run.output[-3000:]
    results = read_results(tmp_path)
    rounds = results["rounds"]
    # partition 3 is a new client: never trained or evaluated in the rounds...
    assert all(r["train"]["num_clients"] == 3 for r in rounds)
    assert all(sorted(r["eval"]["per_client"]) == ["0", "1", "2"] for r in rounds)
    # ...then evaluated with LocalTrain and with the Ensemble of the 3 existing clients
    new = results["new_clients"]
    assert new["clients"] == ["3"] and new["ensemble_members"] == 3
    for name in ("localtrain", "ensemble"):
        assert 0.0 <= new[name]["per_client"]["3"] <= 1.0
    assert all("dropped" not in r for r in rounds)   # uplink shapes matched the split
    analysed = [r["round"] for r in rounds if "fedfac" in r]
    assert analysed == ([1] if mode == "static" else [1, 2, 3])
    report = rounds[0]["fedfac"]["body.0"]
    assert report["num_shared"] == 16 and report["num_elements"] == 32
    if mode == "static":
        # after the split only shared rows go up: fewer bytes than the full layers of round 1
        assert rounds[1]["bytes_up"] < rounds[0]["bytes_up"]
        assert rounds[2]["bytes_up"] == rounds[1]["bytes_up"]
    else:
        assert rounds[1]["fedfac"]["body.0"]["kept_fraction"] is not None
    assert rounds[1]["bytes_down_train"] < rounds[0]["bytes_down_train"]
