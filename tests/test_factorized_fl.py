"""Factorized-FL: factorized layers, L1 on mu, matching weights, uplink, per-client u."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from client_app.runtime import Client
from models.factorized_fl import FactorizedConv2d, FactorizedLinear, l1_of_mu, matching_key
from server_app.app import initial_shared_arrays
from strategies.factorized_fl.server import matching_weights
from strategies.registry import build_model, load_settings
from strategies.training import LocalTraining
from tests.conftest import app_config, read_results

ROOT = Path(__file__).resolve().parents[1]


def test_factorized_linear_reconstructs_w():
    layer = FactorizedLinear(nn.Linear(5, 3))
    with torch.no_grad():
        layer.mu.normal_()
    expected = layer.v[:, None] * layer.u[None, :] + layer.mu   # W[o, i] = v[o] u[i] + mu
    torch.testing.assert_close(layer.weight(), expected)
    x = torch.randn(4, 5)
    torch.testing.assert_close(layer(x), x @ expected.T + layer.bias)


def test_factorized_conv_with_unit_v_repeats_the_spatial_kernel_u():
    layer = FactorizedConv2d(nn.Conv2d(3, 4, 3, padding=1))
    with torch.no_grad():
        layer.v.fill_(1.0)
        layer.mu.zero_()
    kernel = layer.u.view(3, 3)
    weight = layer.weight()
    assert weight.shape == (4, 3, 3, 3)
    for o in range(4):
        for i in range(3):
            torch.testing.assert_close(weight[o, i], kernel)
    with torch.no_grad():
        layer.mu[1, 2] = 0.5
        layer.v[1, 2] = 2.0
    torch.testing.assert_close(layer.weight()[1, 2], 2.0 * kernel + 0.5)


def _client(pid: int = 0, **overrides) -> Client:
    return Client.from_context(Context(
        run_id=1, node_id=pid, node_config={"partition-id": pid, "num-partitions": 4},
        state=RecordDict(), run_config=app_config(**{"method": "factorized-fl", **overrides})))


def test_l1_term_changes_the_gradient_of_mu():
    grads = []
    for l1 in (0.0, 0.1):
        settings = load_settings(app_config(**{"method": "factorized-fl",
                                                             "factorized-fl.l1": l1}))
        model = build_model(settings)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".mu"):
                    p.fill_(0.01)
        x, y = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 3])
        loss = nn.functional.cross_entropy(model(x), y) + l1 * l1_of_mu(model)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if n.endswith(".mu")})
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad - grads[0][name], torch.full_like(grad, 0.1))


def test_matching_weights_sum_to_one_respect_tau_self_and_order():
    rng = np.random.default_rng(0)
    vectors = {str(i): rng.normal(size=6) for i in range(5)}
    vectors["5"] = vectors["0"] * 3.0  # same direction as client 0
    clients, sim, weights = matching_weights(vectors, tau=0.5, epsilon=2.0)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0)
    off = ~np.eye(len(clients), dtype=bool)
    assert np.all(weights[off & (sim < 0.5)] == 0)
    for k in range(len(clients)):
        allowed = (sim[k] >= 0.5) | (np.arange(len(clients)) == k)
        z = np.exp(2.0 * sim[k][allowed]).sum()
        assert weights[k, k] == pytest.approx(np.exp(2.0) / z)
    assert sim[0, 5] == pytest.approx(1.0)
    shuffled = dict(random.Random(1).sample(list(vectors.items()), len(vectors)))
    clients2, _, weights2 = matching_weights(shuffled, tau=0.5, epsilon=2.0)
    assert clients2 == clients
    np.testing.assert_allclose(weights2, weights)


@pytest.mark.parametrize("variant", ["u", "uvm"])
def test_uplink_keys(variant):
    client = _client(**{"factorized-fl.variant": variant})
    model = client.model(initial_shared_arrays(client.settings))
    sent = set(client.shared_arrays(model, ArrayRecord()))
    match = matching_key(model)
    assert match in sent and not any(k.startswith("head.") for k in sent)
    assert not any("running_" in k for k in sent)
    factors = {k.rsplit(".", 1)[-1] for k in sent if k.endswith((".u", ".v", ".mu"))}
    if variant == "u":
        assert factors == {"u", "v"}
        assert [k for k in sent if k.endswith(".v")] == [match]
    else:
        assert factors == {"u", "v", "mu"}


def test_matching_vector_stays_personal_in_variant_u():
    client = _client()
    received = initial_shared_arrays(client.settings)
    model = client.model(received)
    assert matching_key(model) not in received
    torch.manual_seed(0)
    client.method.local_train(LocalTraining(model, client.loader(True, 1), client.settings,
                                            client.device, 1))
    client.keep_personal(model, received, client.shared_arrays(model, received))
    torch.testing.assert_close(client.model(received).state_dict()[matching_key(model)],
                               model.state_dict()[matching_key(model)])


@pytest.mark.integration
def test_real_rounds_uplink_bytes_and_personal_u(federation, tmp_path):
    config = {"method": "factorized-fl", "partitioner": "domain", "domain-groups": 2,
              "permute-labels": True, "num-server-rounds": 2, "local-epochs": 1,
              "factorized-fl.tau": 0.0, "factorized-fl.epsilon": 20.0, "plot": False,
              "output-dir": str(tmp_path / "ffl")}
    run = federation.run(ROOT, config, num_supernodes=4)
    assert run.ok, run.output[-3000:]
    rounds = read_results(tmp_path / "ffl")["rounds"]
    assert all("dropped" not in r for r in rounds)  # uplink keys == the documented ones
    settings = load_settings(app_config(**{"method": "factorized-fl"}))
    model = build_model(settings)
    client = _client()
    sent = client.shared_arrays(client.model(initial_shared_arrays(settings)), ArrayRecord())
    assert rounds[0]["bytes_up"] == 4 * sent.count_bytes()
    assert rounds[0]["bytes_down_train"] == 4 * initial_shared_arrays(settings).count_bytes()
    similarity = rounds[1]["similarity"]
    assert similarity["clients"] == ["0", "1", "2", "3"]
    weights = np.array(similarity["weights"])
    assert not np.allclose(weights[0], weights[1])  # different matches -> different u
    assert rounds[1]["bytes_down_train"] == rounds[0]["bytes_down_train"]
    assert matching_key(model) == "body.9.v"  # the Linear before the classifier
