"""FedFac's server side: factor analysis, quantile split, reference splits, static and
dynamic splitting, server learning rate (its clients: ``tests/test_fedfac_clients.py``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from common.protocol import ClientReply
from strategies.engine import MethodRule, RoundEngine, RuleContext
from strategies.engine.robust import combine
from strategies.fedfac.server import (
    FedFacRule,
    factor_count,
    principal_axis_loadings,
    shared_elements,
)
from strategies.registry import initial_state, load_settings, wire_spec
from tests.conftest import app_config

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


GRADED = np.random.default_rng(2).permutation(np.linspace(0.05, 0.9, 12))


def _graded_weights(num_clients: int = 8, fan_in: int = 400) -> list[np.ndarray]:
    """One common factor; element ``j`` has true communality ``GRADED[j]`` (shuffled)."""
    rng = np.random.default_rng(1)
    weights = []
    for _ in range(num_clients):
        factor = rng.normal(size=(fan_in, 1))
        noise = rng.normal(size=(fan_in, len(GRADED))) * np.sqrt(1 - GRADED)
        weights.append((factor * np.sqrt(GRADED) + noise).T)
    return weights


@pytest.mark.parametrize(("quantile", "num_shared"), [(0.25, 9), (0.5, 6), (0.75, 3)])
def test_quantile_threshold_shares_the_elements_of_highest_true_communality(quantile,
                                                                           num_shared):
    """Against the generating model, not the function's own output: the shared elements are
    exactly the ``num_shared`` elements whose true communality is highest."""
    mask, nu, factors = shared_elements(_graded_weights(), kappa=0.2, tau_quantile=quantile)
    assert factors == 1
    np.testing.assert_allclose(nu, GRADED, atol=0.05)
    assert set(np.flatnonzero(mask)) == set(np.argsort(GRADED)[::-1][:num_shared])


def test_sampled_weights_recover_the_shared_elements():
    mask, _, factors = shared_elements(_sampled_weights(), kappa=0.25, tau_quantile=10 / 16)
    assert set(np.flatnonzero(mask)) == set(range(6))
    assert factors == 2


def test_quantile_above_one_is_personal_below_zero_is_shared():
    assert not shared_elements(_sampled_weights(), 0.85, 1.5)[0].any()
    assert shared_elements(_sampled_weights(), 0.85, -0.5)[0].all()


def fedfac_rule(settings, wire=None, rule=FedFacRule) -> MethodRule:
    """A method's server rule as a run's engine holds it."""
    return RoundEngine(settings, wire or wire_spec(settings), rule).rule


def _start(rule: MethodRule) -> ArrayRecord:
    """The shared arrays round 1 starts from."""
    return initial_state(rule.settings).arrays


def _mlp_rule(**overrides) -> FedFacRule:
    """FedFac on a 60-input, 16-unit MLP layer (``body.1``)."""
    settings = load_settings(app_config(**{
        "method": "fedfac", "dataset": "synthetic-fedfac", "model": "mlp", "mlp-hidden": 16,
        "synthetic.dim": 60, "synthetic.hidden": 16, "fedfac.kappa": 0.25,
        "fedfac.tau-quantile": 10 / 16, **overrides}))
    return fedfac_rule(settings)


def _replies_around(arrays: ArrayRecord, layer_weights: list[np.ndarray]) -> list[ClientReply]:
    replies = []
    for client, weight in enumerate(layer_weights):
        record = dict(arrays.items())
        record["body.1.weight"] = Array(weight.astype(np.float32))
        replies.append(ClientReply(client, str(client), ArrayRecord(record),
                                   MetricRecord({"num-examples": 10 + client}),
                                   ConfigRecord({})))
    return replies


def _split_after_correlated_updates(rule: FedFacRule, arrays: ArrayRecord,
                                    server_round: int = 1) -> np.ndarray:
    """``body.1``'s split after a round whose 8 clients moved from ``arrays`` by small updates
    whose first 6 elements follow common factors."""
    start = arrays["body.1.weight"].numpy()
    updates = [0.01 * start.std() * d for d in _sampled_weights(8, 60)]
    rule.merge_updates(server_round, _replies_around(arrays, [start + d for d in updates]),
                       arrays)
    return rule.split["body.1"]


@pytest.mark.parametrize("analysis", ["updates", "weights"])
def test_split_from_updates_finds_the_shared_elements_weights_find_the_initialisation(
        analysis):
    """Clients start from one initialisation ``W0`` and move by small updates whose first 6
    elements follow common factors. On updates (default) the split finds those 6; on weights
    it is the split of ``W0`` alone, whatever the updates are."""
    rule = _mlp_rule(**({} if analysis == "updates" else {"fedfac.analysis": analysis}))
    arrays = _start(rule)
    split = _split_after_correlated_updates(rule, arrays)
    of_start = shared_elements([arrays["body.1.weight"].numpy()] * 8, 0.25, 10 / 16)[0]
    if analysis == "updates":
        assert set(np.flatnonzero(split)) == set(range(6))
    else:
        np.testing.assert_array_equal(split, of_start)
        assert set(np.flatnonzero(split)) != set(range(6))


def test_random_reference_split_has_the_estimates_size_and_is_seeded():
    """``fedfac.split = random`` (the matrix's reference for FedFac's split claim): as many
    shared elements as the estimate finds (6 of 16 here), drawn at random, the same for the
    same seed and round."""
    def split_of(**overrides) -> np.ndarray:
        rule = _mlp_rule(**overrides)
        return _split_after_correlated_updates(rule, _start(rule))

    estimated = split_of()
    random_splits = [split_of(**{"fedfac.split": "random", "seed": seed}) for seed in (0, 0, 1)]
    assert all(r.sum() == estimated.sum() == 6 for r in random_splits)
    np.testing.assert_array_equal(random_splits[0], random_splits[1])
    assert not np.array_equal(random_splits[0], random_splits[2])
    assert any(set(np.flatnonzero(r)) != set(range(6)) for r in random_splits)


def test_warmup_rounds_are_fedavg_then_the_split_comes_from_that_rounds_updates():
    rule = _mlp_rule(**{"fedfac.warmup-rounds": 2})
    arrays = _start(rule)
    rng = np.random.default_rng(3)
    for server_round in (1, 2):
        replies = _replies_around(arrays, [arrays["body.1.weight"].numpy() + rng.normal(
            size=(16, 60)) for _ in range(4)])
        assert rule.uplink_rows() is None
        new = rule.merge_updates(server_round, replies, arrays)
        assert rule.split is None and rule.downlink(server_round, "0", new) is new
        total = sum(r.num_examples for r in replies)
        np.testing.assert_allclose(new["body.1.weight"].numpy(), sum(
            r.arrays["body.1.weight"].numpy() * r.num_examples / total for r in replies),
            rtol=1e-5, atol=1e-6)
        arrays = new
    split = _split_after_correlated_updates(rule, arrays, server_round=3)
    assert set(np.flatnonzero(split)) == set(range(6))


def _round(rule: FedFacRule, arrays: ArrayRecord, server_round: int,
           shared_first: int) -> ArrayRecord:
    """One round whose 8 clients moved from ``arrays`` by small updates whose elements
    ``shared_first .. shared_first + 5`` follow common factors; each client sends what a
    client of that round sends: whole rows, or only the shared rows where the server asks for
    a sliced uplink."""
    start = arrays["body.1.weight"].numpy()
    updates = [np.roll(0.01 * start.std() * d, shared_first, axis=0)
               for d in _sampled_weights(8, 60)]
    replies = _replies_around(arrays, [start + d for d in updates])
    masks = rule.uplink_rows()
    if masks is not None:
        for reply in replies:
            for key, layer in rule.wire.layer_of_key.items():
                reply.arrays[key] = Array(reply.arrays[key].numpy()[masks[layer]])
    return rule.merge_updates(server_round, replies, arrays)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_static_splits_once_and_slices_its_uplink_dynamic_splits_every_round(mode):
    """Round 1's clients share elements 0-5, round 2's elements 10-15. Static keeps round
    1's split and from round 2 on asks only for the shared rows (personal rows never leave a
    client); dynamic splits again on round 2's whole rows."""
    rule = _mlp_rule(**{"fedfac.mode": mode})
    arrays = _round(rule, _start(rule), 1, shared_first=0)
    first = rule.split["body.1"].copy()
    assert set(np.flatnonzero(first)) == set(range(6))
    if mode == "static":
        np.testing.assert_array_equal(rule.uplink_rows()["body.1"], first)
    else:
        assert rule.uplink_rows() is None
    _round(rule, arrays, 2, shared_first=10)
    second = set(np.flatnonzero(rule.split["body.1"]))
    assert second == (set(range(6)) if mode == "static" else set(range(10, 16)))


def test_server_lr_moves_the_shared_part_that_fraction_of_the_way_to_the_mean():
    """``fedfac.server-lr`` 0.5: half way from the round's start to the clients' mean (here
    in FedAvg warm-up rounds, where everything is shared)."""
    moved = {}
    for server_lr in (1.0, 0.5):
        rule = _mlp_rule(**{"fedfac.warmup-rounds": 1, "fedfac.server-lr": server_lr})
        arrays = _start(rule)
        moved[server_lr] = _round(rule, arrays, 1, shared_first=0)
    start = arrays["body.1.weight"].numpy()
    np.testing.assert_allclose(moved[0.5]["body.1.weight"].numpy() - start,
                               0.5 * (moved[1.0]["body.1.weight"].numpy() - start),
                               rtol=1e-4, atol=1e-7)
    assert not np.allclose(moved[1.0]["body.1.weight"].numpy(), start)


@pytest.mark.parametrize("aggregation", ["mean", "median"])
def test_fedfac_merges_its_shared_rows_through_the_rule_context(monkeypatch, aggregation):
    """As every method's, FedFac's merge is ``RuleContext.aggregate`` (the run's
    ``aggregation.*`` rule, and under central DP the privacy ledger), of the shared rows in
    float64: bit for bit the mean it took from ``combine`` before, so its runs reproduce."""
    calls = []
    aggregate = RuleContext.aggregate

    def spy(self, replies, keys, reference, uniform=False, dtype=None):
        calls.append((list(keys), dtype))
        return aggregate(self, replies, keys, reference, uniform, dtype)

    monkeypatch.setattr(RuleContext, "aggregate", spy)
    rule = _mlp_rule(**{"fedfac.warmup-rounds": 1, "aggregation.rule": aggregation})
    arrays = _start(rule)
    start = arrays["body.1.weight"].numpy()
    replies = _replies_around(arrays, [start + 0.01 * d for d in _sampled_weights(8, 60)])
    merged = rule.merge_updates(1, replies, arrays)  # a warm-up round: everything shared
    assert calls == [(list(arrays), np.float64)]
    mean = combine([{k: r.arrays[k].numpy() for k in arrays} for r in replies],
                   [r.num_examples for r in replies],
                   {k: v.numpy() for k, v in arrays.items()}, rule.settings)
    for key, value in arrays.items():
        old = value.numpy().astype(np.float64)
        expected = (old + 1.0 * (mean[key] - old)).astype(value.numpy().dtype)
        assert np.array_equal(merged[key].numpy(), expected), key
