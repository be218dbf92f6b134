"""Factorized-FL: factorized layers, L1 on mu, matching weights, uplink, per-client u."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn

from bench.run_methods import same_domain_weight
from client_app.runtime import Client
from common.protocol import ClientReply
from models.factorized_fl import (
    FactorizedConv2d,
    FactorizedLinear,
    factorized_layers,
    l1_of_mu,
    matching_key,
)
from strategies.engine import RoundEngine
from strategies.factorized_fl.server import FactorizedFLRule, matching_weights
from strategies.factorized_fl.spec import FactorsShared
from strategies.registry import build_model, initial_state, load_settings, wire_spec
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


def test_training_rule_adds_the_l1_penalty_on_mu_with_its_gradient():
    """One plain SGD step of the method's local rule with and without ``l1``, from the same
    model and batch: every ``mu`` entry differs by exactly ``-lr * l1 * sign(mu)``, every other
    parameter not at all."""
    lr, l1 = 0.1, 0.05
    after = []
    for penalty in (0.0, l1):
        client = _client(**{"factorized-fl.l1": penalty, "lr": lr, "momentum": 0.0,
                            "batch-size": 10_000, "local-epochs": 1})
        model = client.model(initial_state(client.settings).arrays)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".mu"):
                    p.copy_(torch.where(torch.rand_like(p, generator=torch.Generator(
                    ).manual_seed(0)) < 0.5, -0.01, 0.01))
        signs = {n: p.detach().sign() for n, p in model.named_parameters()}
        assert len(client.loader(True, 1)) == 1  # one batch: one step
        client.method.local_train(LocalTraining(model, client.loader(True, 1),
                                                client.settings, client.device, 1))
        after.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, value in after[1].items():
        expected = -lr * l1 * signs[name] if name.endswith(".mu") else torch.zeros_like(value)
        torch.testing.assert_close(value - after[0][name], expected, rtol=0, atol=1e-6)


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


@pytest.mark.parametrize(("model", "penultimate"), [("cnn", "body.9"),
                                                    ("user_models:classifier_first",
                                                     "body.hidden")])
def test_the_matching_vector_is_v_of_the_layer_that_feeds_the_classifier(model, penultimate):
    """The paper matches clients on the penultimate layer's ``v``, whatever order the model
    registers its layers in (the user model registers its hidden Linear before its conv
    stage, which runs first)."""
    settings = load_settings(app_config(method="factorized-fl", model=model))
    assert isinstance(build_model(settings).get_submodule(penultimate), FactorizedLinear)
    assert wire_spec(settings).match_key == f"{penultimate}.v"


@pytest.mark.parametrize("variant", ["u", "u-paper", "uvm"])
def test_uplink_keys(variant):
    client = _client(**{"factorized-fl.variant": variant})
    model = client.model(initial_state(client.settings).arrays)
    sent = set(client.shared_arrays(model, ArrayRecord()))
    received = set(initial_state(client.settings).arrays)
    match = matching_key(model, (1, 8, 8))
    assert sent == received | {match}
    assert match in sent and not any(k.startswith("head.") for k in sent)
    assert not any("running_" in k for k in sent)
    factors = {k.rsplit(".", 1)[-1] for k in sent if k.endswith((".u", ".v", ".mu"))}
    every_u = {f"{layer}.u" for layer in factorized_layers(model)}
    bn_affine = {f"{name}.{p}" for name, m in model.named_modules()
                 if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in ("weight", "bias")}
    body_bias = {f"{layer}.bias" for layer in factorized_layers(model)
                 if getattr(model.get_submodule(layer), "bias", None) is not None}
    assert bn_affine and body_bias
    if variant == "u-paper":  # the paper's set: only u (plus the matching vector up)
        assert sent == every_u | {match}
    elif variant == "u":      # the authors' code: u, body biases and BatchNorm affine
        assert factors == {"u", "v"}
        assert [k for k in sent if k.endswith(".v")] == [match]
        assert sent == every_u | bn_affine | body_bias | {match}
    else:
        assert factors == {"u", "v", "mu"}
        assert bn_affine | body_bias <= sent


def test_matching_vector_stays_personal_in_variant_u():
    client = _client()
    received = initial_state(client.settings).arrays
    model = client.model(received)
    assert matching_key(model, (1, 8, 8)) not in received
    torch.manual_seed(0)
    client.method.local_train(LocalTraining(model, client.loader(True, 1), client.settings,
                                            client.device, 1))
    client.keep_personal(model, received, client.shared_arrays(model, received))
    torch.testing.assert_close(client.model(received).state_dict()[matching_key(model, (1, 8, 8))],
                               model.state_dict()[matching_key(model, (1, 8, 8))])


def _upload(settings, client_id: str, rng: np.random.Generator, examples: int) -> ClientReply:
    spec = FactorsShared(build_model(settings), settings).uplink_spec({}, None)
    arrays = ArrayRecord({k: Array(rng.normal(size=shape).astype(dtype))
                          for k, (shape, dtype) in spec.items()})
    return ClientReply(int(client_id), client_id, arrays,
                       MetricRecord({"num-examples": examples}), ConfigRecord({}))


def test_each_downlink_is_its_similarity_weighted_sum_of_the_latest_uploads():
    """Round 1: four clients upload; round 2: only clients 0 and 2. Client ``k``'s downlink
    is ``sum_i w_ki x_i`` over every known client's latest upload ``x_i``, with
    ``w_ki = exp(eps s_ki) / sum_j exp(eps s_kj)`` over ``s_ki >= tau`` (itself included),
    ``s`` the cosine similarity of the matching vectors."""
    tau, eps = 0.0, 3.0
    settings = load_settings(app_config(**{"method": "factorized-fl", "factorized-fl.tau": tau,
                                           "factorized-fl.epsilon": eps}))
    arrays = initial_state(settings).arrays
    strategy = RoundEngine(settings, wire_spec(settings), FactorizedFLRule)
    match = strategy.wire.match_key
    rng = np.random.default_rng(0)
    latest, excluded = {}, 0
    for server_round, present in ((1, "0123"), (2, "02")):
        replies = [_upload(settings, c, rng, 10 + int(c)) for c in present]
        latest.update({r.client_id: {k: v.numpy() for k, v in r.arrays.items()}
                       for r in replies})
        strategy.rule.merge_updates(server_round, replies, arrays)
        ids = sorted(latest)
        vectors = np.stack([latest[c][match].ravel() for c in ids])
        unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
        similarity = unit @ unit.T
        for row, client in enumerate(ids):
            allowed = (similarity[row] >= tau) | (np.arange(len(ids)) == row)
            logits = np.where(allowed, eps * np.where(np.arange(len(ids)) == row, 1.0,
                                                      similarity[row]), -np.inf)
            weights = np.exp(logits) / np.exp(logits).sum()
            excluded += int((~allowed).sum())
            down = strategy.rule.downlink(server_round + 1, client, arrays)
            assert set(down) == set(arrays)  # the shared keys; the matching vector stays up
            for key in arrays:
                expected = sum(w * latest[other][key] for w, other in zip(weights, ids,
                                                                          strict=True))
                np.testing.assert_allclose(down[key].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert excluded > 0  # tau took some clients out of some rows


def test_a_client_never_seen_gets_the_example_weighted_average_of_the_round():
    """No upload of its own to match on: the round's replies averaged by their examples
    (FedAvg's rule), the same for every new client; a known client gets its own average."""
    settings = load_settings(app_config(**{"method": "factorized-fl"}))
    arrays = initial_state(settings).arrays
    strategy = RoundEngine(settings, wire_spec(settings), FactorizedFLRule)
    replies = [_upload(settings, c, np.random.default_rng(int(c)), n)
               for c, n in (("0", 10), ("1", 30))]
    merged = strategy.rule.merge_updates(1, replies, arrays)
    for key in strategy.wire.shared_spec:
        expected = (10 * replies[0].arrays[key].numpy().astype(np.float64)
                    + 30 * replies[1].arrays[key].numpy()) / 40
        np.testing.assert_allclose(merged[key].numpy(), expected, rtol=1e-5, atol=1e-6)
    new = strategy.rule.downlink(2, "7", merged)
    assert {k: new[k].numpy().tolist() for k in new} == \
        {k: merged[k].numpy().tolist() for k in merged}
    own = strategy.rule.downlink(2, "0", merged)
    assert any(not np.allclose(own[k].numpy(), merged[k].numpy()) for k in own)


def test_many_clients_build_only_the_downlinks_sent_and_summarise_the_matrix():
    """100 known clients, cross-device's federation (above ``MATRIX_IN_RESULTS``): a downlink
    is built only when asked for, equals the row's weighted average of the latest uploads
    (``matching_weights``), is rebuilt after the next aggregation, and survives a checkpoint;
    the round's entry holds a summary instead of two 100 x 100 matrices."""
    settings = load_settings(app_config(**{"method": "factorized-fl", "factorized-fl.tau": 0.0}))
    arrays = initial_state(settings).arrays
    strategy = RoundEngine(settings, wire_spec(settings), FactorizedFLRule)
    rng = np.random.default_rng(1)
    replies = [_upload(settings, str(c), rng, 5) for c in range(100)]
    strategy.rule.merge_updates(1, replies, arrays)
    summary = strategy.ledger.record(1).extra["similarity"]
    assert summary["num_clients"] == 100 and "matrix" not in summary
    domain = {"config": {"partitioner": "domain", "domain-groups": 2}}
    assert same_domain_weight({**domain, "rounds": [{"similarity": summary}]}) is None
    assert 1 <= summary["neighbours_mean"] <= 100
    assert strategy.rule._personal == {}
    clients, _, weights = matching_weights(
        {r.client_id: r.arrays[strategy.wire.match_key].numpy() for r in replies},
        settings.method_settings.tau, settings.method_settings.epsilon)
    asked = ["3", "77", "99"]
    downs = {c: strategy.rule.downlink(2, c, arrays) for c in asked}
    assert sorted(strategy.rule._personal) == sorted(asked)
    for client, down in downs.items():
        row = weights[clients.index(client)]
        for key in arrays:
            expected = sum(w * r.arrays[key].numpy().astype(np.float64)
                           for w, r in zip(row, sorted(replies, key=lambda r: int(r.client_id)),
                                           strict=True))
            np.testing.assert_allclose(down[key].numpy(), expected, rtol=1e-5, atol=1e-6)
    resumed = RoundEngine(settings, wire_spec(settings), FactorizedFLRule)
    resumed.restore(strategy.snapshot(2))
    for client, down in downs.items():
        again = resumed.rule.downlink(2, client, arrays)
        for key in arrays:
            np.testing.assert_array_equal(again[key].numpy(), down[key].numpy())
    strategy.rule.merge_updates(2, [_upload(settings, "3", rng, 5)], arrays)
    assert strategy.rule._personal == {}  # a new snapshot: downlinks are built from it
    assert not np.array_equal(strategy.rule.downlink(3, "3", arrays)[next(iter(arrays))].numpy(),
                              downs["3"][next(iter(arrays))].numpy())


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
    client = _client()
    sent = client.shared_arrays(client.model(initial_state(settings).arrays), ArrayRecord())
    assert rounds[0]["bytes_up"] == 4 * sent.count_bytes()
    assert rounds[0]["bytes_down_train"] == 4 * initial_state(settings).arrays.count_bytes()
    similarity = rounds[1]["similarity"]
    assert similarity["clients"] == ["0", "1", "2", "3"]
    weights = np.array(similarity["weights"])
    assert not np.allclose(weights[0], weights[1])  # different matches -> different u
    assert 0.0 <= same_domain_weight(read_results(tmp_path / "ffl")) <= 1.0  # bench's note
    assert rounds[1]["bytes_down_train"] == rounds[0]["bytes_down_train"]


def test_an_expired_client_leaves_the_matching_of_the_others():
    """Client 0 is not heard from for ``identity.expire-rounds`` rounds: its upload is
    forgotten, and the others' downlinks are their weighted averages over the rest only."""
    settings = load_settings(app_config(**{"method": "factorized-fl", "factorized-fl.tau": 0.0,
                                           "identity.expire-rounds": 1}))
    arrays = initial_state(settings).arrays
    strategy = RoundEngine(settings, wire_spec(settings), FactorizedFLRule)
    rng = np.random.default_rng(2)
    replies = [_upload(settings, str(c), rng, 5) for c in range(3)]
    strategy.rule.merge_updates(1, replies, arrays)
    before = strategy.rule.downlink(2, "1", arrays)
    strategy.nodes.last_seen.update({"0": 1, "1": 3, "2": 3})
    strategy.forget_expired(3)
    assert sorted(strategy.rule.latest) == ["1", "2"]
    clients, _, weights = matching_weights(
        {r.client_id: r.arrays[strategy.wire.match_key].numpy() for r in replies[1:]},
        settings.method_settings.tau, settings.method_settings.epsilon)
    after = strategy.rule.downlink(3, "1", arrays)
    row = weights[clients.index("1")]
    for key in arrays:
        expected = sum(w * r.arrays[key].numpy().astype(np.float64)
                       for w, r in zip(row, replies[1:], strict=True))
        np.testing.assert_allclose(after[key].numpy(), expected, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(after[next(iter(arrays))].numpy(),
                              before[next(iter(arrays))].numpy())


# ---------------------------------------------------------------------- the papers' settings
def test_min_aggregated_takes_the_nearest_clients_when_too_few_pass_tau():
    """The authors' minimum aggregation: with ``tau = 1`` nobody else passes, so each client
    averages with itself and its ``n - 1`` most similar clients, weighted
    ``softmax(epsilon * sigma)`` over exactly those; ``n`` above the number of clients takes
    them all; ``n = 1`` is today's rule (only itself)."""
    rng = np.random.default_rng(4)
    vectors = {str(i): rng.normal(size=5) for i in range(6)}
    eps = 3.0
    _, _, weights1 = matching_weights(vectors, tau=1.0, epsilon=eps)
    np.testing.assert_allclose(weights1, np.eye(6))
    _, sim, weights = matching_weights(vectors, tau=1.0, epsilon=eps, min_aggregated=3)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0)
    for k in range(6):
        others = [i for i in np.argsort(-sim[k]) if i != k][:2]
        members = sorted([k, *others])
        assert sorted(np.flatnonzero(weights[k])) == members
        z = np.exp(eps * sim[k][members]).sum()
        np.testing.assert_allclose(weights[k][members], np.exp(eps * sim[k][members]) / z)
    _, _, everyone = matching_weights(vectors, tau=1.0, epsilon=eps, min_aggregated=50)
    assert (everyone > 0).all()
    np.testing.assert_allclose(everyone, np.exp(eps * sim) / np.exp(eps * sim).sum(
        axis=1, keepdims=True))
    # tau still adds everyone above it: the floor only ever adds clients
    _, _, loose = matching_weights(vectors, tau=-1.0, epsilon=eps, min_aggregated=2)
    assert (loose > 0).all()


def test_the_server_uses_min_aggregated():
    settings = load_settings(app_config(**{"method": "factorized-fl", "factorized-fl.tau": 1.0,
                                           "factorized-fl.min-aggregated": 2}))
    arrays = initial_state(settings).arrays
    strategy = RoundEngine(settings, wire_spec(settings), FactorizedFLRule)
    rng = np.random.default_rng(5)
    strategy.rule.merge_updates(1, [_upload(settings, str(c), rng, 5) for c in range(4)], arrays)
    weights = np.array(strategy.ledger.record(1).extra["similarity"]["weights"])
    assert ((weights > 0).sum(axis=1) == 2).all()


def test_l1_zero_computes_no_penalty(monkeypatch):
    """``factorized-fl.l1 = 0`` is allowed and costs nothing: the penalty is never computed
    (with ``l1 > 0`` it is, once per step)."""
    import strategies.factorized_fl.client as local_rule

    calls = []

    def counted(model):
        calls.append(1)
        return l1_of_mu(model)

    monkeypatch.setattr(local_rule, "l1_of_mu", counted)
    for l1, computed in ((0.0, False), (0.0005, True)):
        calls.clear()
        client = _client(**{"factorized-fl.l1": l1, "local-epochs": 1})
        model = client.model(initial_state(client.settings).arrays)
        client.method.local_train(LocalTraining(model, client.loader(True, 1),
                                                client.settings, client.device, 1))
        assert bool(calls) == computed
