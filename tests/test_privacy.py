"""Differential privacy (docs/privacy.md): clipping, noise, the accountant against
dp-accounting's own computation, the budget stop, and the configs that would break the bound
(adaptive clipping: test_adaptive_clipping.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant as ReferenceAccountant
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from client_app.app import train
from common.config import ConfigError
from common.durable import load_tree, save_tree
from common.protocol import (
    ARRAYS,
    CLIENT_ID,
    CONFIG,
    DP_CLIP_NORM,
    DP_CLIPPED,
    NUM_EXAMPLES,
    SERVER_ROUND,
    ClientReply,
)
from strategies.engine.privacy import BudgetSpentError, PrivacyLedger, default_delta
from strategies.privacy import noised_mean, privatize_uplink
from strategies.registry import initial_state, load_settings
from tests.conftest import app_config, make_client

SHAPES = {"conv.weight": (4, 3, 3, 3), "conv.bias": (4,), "fc.weight": (10, 36)}


def arrays(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    return {k: (rng.normal(size=shape) * scale).astype(np.float32)
            for k, shape in SHAPES.items()}


def norm(update: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64)))
                         for v in update.values()))


def record(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in values.items()})


def reply(client_id: str, values: dict[str, np.ndarray], clipped: float) -> ClientReply:
    return ClientReply(node_id=0, client_id=client_id, arrays=record(values),
                       metrics=MetricRecord({NUM_EXAMPLES: 10, DP_CLIPPED: clipped}),
                       info=ConfigRecord({CLIENT_ID: client_id}))


def settings(**overrides):
    return load_settings(app_config(**{"dp.mode": "central", **overrides}))


class NoNoise:
    """A generator without noise: what the clip alone does is then visible."""

    def normal(self, loc, scale, size=None):
        return np.zeros(size) if size is not None else 0.0


# ---------------------------------------------------------------------- clipping
@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_client_update_leaves_clipped_to_the_clip_norm(mode):
    rng = np.random.default_rng(0)
    start = arrays(rng, 1.0)
    for scale, clip_norm in [(5.0, 1.0), (0.001, 1.0), (1.0, 0.3)]:
        trained = {k: v + arrays(rng, scale)[k] for k, v in start.items()}
        sent, clipped = privatize_uplink(record(trained), record(start), mode, clip_norm,
                                         1.0, NoNoise())
        update = {k: sent[k].numpy() - start[k] for k in SHAPES}
        before = norm({k: trained[k] - start[k] for k in SHAPES})
        assert clipped == (before > clip_norm)
        assert norm(update) <= clip_norm * (1 + 1e-5)
        if not clipped:  # a short update goes as it is
            assert all(np.array_equal(sent[k].numpy(), trained[k]) for k in SHAPES)
        assert {k: (sent[k].shape, sent[k].dtype) for k in SHAPES} == \
            {k: (record(trained)[k].shape, record(trained)[k].dtype) for k in SHAPES}


def test_the_server_clips_an_update_a_site_did_not_clip():
    rng = np.random.default_rng(1)
    start = arrays(rng, 1.0)
    hostile = {k: v + arrays(rng, 100.0)[k] for k, v in start.items()}
    small = {k: v + arrays(rng, 0.001)[k] for k, v in start.items()}
    merged, clipped_here = noised_mean(
        [[hostile[k] for k in SHAPES], [small[k] for k in SHAPES]],
        [start[k].astype(np.float64) for k in SHAPES], 1.0, 0.0, NoNoise())
    hostile_part = {k: 2 * (merged[i] - start[k]) - (small[k] - start[k])
                    for i, k in enumerate(SHAPES)}
    assert clipped_here == 1
    assert norm(hostile_part) == pytest.approx(1.0, rel=1e-5)


def along(rng: np.random.Generator, start: dict[str, np.ndarray], length: float
          ) -> dict[str, np.ndarray]:
    """``start`` moved by a random update of L2 norm ``length``."""
    direction = arrays(rng, 1.0)
    scale = length / norm(direction)
    return {k: start[k] + direction[k] * scale for k in SHAPES}


def test_an_update_just_past_the_clip_norm_is_clipped_by_the_client_and_the_server():
    """At 1.5 times the clip norm (a clip that triggered at twice it would miss it): the
    client's update leaves at the clip norm, and the server brings an unclipped one there."""
    rng = np.random.default_rng(5)
    start = {k: v.astype(np.float64) for k, v in arrays(rng, 1.0).items()}
    trained = along(rng, start, 1.5)
    sent, clipped = privatize_uplink(record(trained), record(start), "central", 1.0, 1.0,
                                     NoNoise())
    assert clipped and norm({k: sent[k].numpy() - start[k] for k in SHAPES}) == \
        pytest.approx(1.0, rel=1e-9)
    merged, clipped_here = noised_mean([[trained[k] for k in SHAPES]],
                                       [start[k] for k in SHAPES], 1.0, 0.0, NoNoise())
    assert clipped_here == 1
    # the client's own clip is not the server's; one 1% past the norm (not rounding) is
    assert noised_mean([[sent[k].numpy() for k in SHAPES], list(along(rng, start, 1.01).values())],
                       [start[k] for k in SHAPES], 1.0, 0.0, NoNoise())[1] == 1
    # nor is a float32 client's clip that rounding leaves a hair past the norm
    start32 = arrays(rng, 1.0)
    sent32 = [privatize_uplink(record({k: v.astype(np.float32) for k, v in along(
        rng, start32, 1.5).items()}), record(start32), "central", 1.0, 1.0, NoNoise())[0]
        for _ in range(20)]
    assert noised_mean([[s[k].numpy() for k in SHAPES] for s in sent32],
                       [start32[k].astype(np.float64) for k in SHAPES], 1.0, 0.0,
                       NoNoise())[1] == 0
    assert norm({k: merged[i] - start[k] for i, k in enumerate(SHAPES)}) == \
        pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("mode", ["central", "local"])
def test_a_client_clips_to_the_rounds_clip_norm_and_says_so_only_to_a_trusted_server(mode):
    """The clip norm of the round's message (adaptive clipping moves it) wins over the run's
    ``dp.clip-norm``; whether the update was clipped goes up only under ``central``: under
    ``local`` that bit would leave the client without noise."""
    client = make_client(0, app_config(**{"dp.mode": mode, "dp.clip-norm": 1.0,
                                          "dp.noise-multiplier": 1e-9}))
    rng = np.random.default_rng(8)
    start = arrays(rng, 1.0)
    for length, round_clip in ((0.5, 0.25), (1.5, 2.0)):  # the round's norm below, above
        sent, privacy = client.privatized(record(along(rng, start, length)), record(start),
                                          ConfigRecord({DP_CLIP_NORM: round_clip}))
        assert norm({k: sent[k].numpy() - start[k] for k in SHAPES}) == pytest.approx(
            min(length, round_clip), rel=1e-4)
        clipped = float(length > round_clip)
        assert privacy == ({DP_CLIPPED: clipped} if mode == "central" else {})


def test_a_drawn_client_whose_update_did_not_arrive_counts_as_a_zero_update():
    """The mean is over the clients drawn, not the replies: 4 drawn, 2 replied with the same
    update, the merge moves by half of it (a drop must not show through the mean). The
    clipped fraction reported is of the replies: a missing one has no clipped bit."""
    rng = np.random.default_rng(6)
    start = arrays(rng, 1.0)
    trained = along(rng, start, 0.5)
    ledger = population(PrivacyLedger(settings(**{"dp.noise-multiplier": 1.0}),
                                       rng=NoNoise()), 8)
    draw = (["0", "1", "2", "3"], 8)
    merged, note = ledger.merge([reply("0", trained, 0.0), reply("1", trained, 1.0)],
                                list(SHAPES), record(start), drawn=4)
    assert ledger.account(draw, True, note)["clipped_fraction"] == 0.5
    for k in SHAPES:
        np.testing.assert_allclose(merged[k].numpy() - start[k],
                                   (trained[k] - start[k]) / 2, atol=1e-6)


def test_a_central_round_that_merged_nothing_releases_nothing():
    """Every reply dropped: no noised sum left the server, so the round spends no epsilon."""
    ledger = population(PrivacyLedger(settings(**{"dp.noise-multiplier": 1.0})), 10)
    spent = ledger.account((["0", "1"], 10), True)["epsilon"]
    assert ledger.account((["2", "3"], 10), False) == {"mode": "central", "epsilon": spent,
                                     "delta": default_delta(10), "noise_multiplier": 1.0,
                                     "clip_norm": 1.0, "clipped_fraction": None}


def test_the_noise_is_noise_multiplier_times_clip_norm_on_the_sum():
    """Central: the sum of n updates gets N(0, (z C)^2), the mean (z C / n)^2; local: each
    update gets (z C)^2 (a fixed-seed generator, 60,000 draws: within 2%)."""
    z, clip_norm, n = 1.3, 0.7, 4
    big = {"w": (200, 300)}
    start = {k: np.zeros(s, np.float32) for k, s in big.items()}
    ledger = population(PrivacyLedger(settings(**{"dp.noise-multiplier": z,
                                                  "dp.clip-norm": clip_norm}),
                                      rng=np.random.default_rng(3)), n)
    merged, _ = ledger.merge([reply(str(i), start, 0.0) for i in range(n)], ["w"],
                             record(start), drawn=n)
    assert np.std(merged["w"].numpy()) == pytest.approx(z * clip_norm / n, rel=0.02)
    sent, _ = privatize_uplink(record(start), record(start), "local", clip_norm, z,
                               np.random.default_rng(4))
    assert np.std(sent["w"].numpy()) == pytest.approx(z * clip_norm, rel=0.02)
    assert abs(np.mean(sent["w"].numpy())) < 0.02 * z * clip_norm


# ---------------------------------------------------------------------- accounting
def reference_epsilon(event: dp_event.DpEvent, relation: NeighboringRelation, count: int,
                      delta: float) -> float:
    accountant = ReferenceAccountant(neighboring_relation=relation)
    accountant.compose(event, count)
    return accountant.get_epsilon(delta)


def population(ledger: PrivacyLedger, size: int) -> PrivacyLedger:
    ledger.fix_population({str(i): {"num-partitions": size} for i in range(size)})
    return ledger


def test_central_epsilon_is_dp_accountings_for_the_same_rounds_sampling_and_noise():
    """20 clients, 5 drawn a round without replacement, noise multiplier 1.1 (the
    accountant's 0.55: replace-one doubles the sensitivity), 3 rounds; then a round with only
    10 clients eligible is accounted at its real ratio, 5 of 10 (10 of the 20)."""
    z, size, drawn = 1.1, 20, 5
    ledger = population(PrivacyLedger(settings(**{"dp.noise-multiplier": z})), size)
    delta = default_delta(size)
    event = dp_event.SampledWithoutReplacementDpEvent(size, drawn,
                                                      dp_event.GaussianDpEvent(z / 2))
    for server_round in range(1, 4):
        spent = ledger.account(([str(i) for i in range(drawn)], size), True)
        expected = reference_epsilon(event, NeighboringRelation.REPLACE_ONE, server_round,
                                     delta)
        assert spent["epsilon"] == pytest.approx(expected, rel=1e-12)
        assert spent["delta"] == delta == 1e-5
    assert spent["mode"] == "central" and spent["noise_multiplier"] == z
    reference = ReferenceAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    reference.compose(event, 3)
    reference.compose(dp_event.SampledWithoutReplacementDpEvent(
        size, 10, dp_event.GaussianDpEvent(z / 2)))
    assert ledger.account(([str(i) for i in range(drawn)], 10), True)["epsilon"] == \
        pytest.approx(reference.get_epsilon(delta), rel=1e-12)


def test_local_epsilon_is_the_most_drawn_clients_composition_without_amplification():
    z = 2.0
    ledger = population(PrivacyLedger(settings(**{"dp.mode": "local", "dp.noise-multiplier": z,
                                                  "dp.delta": 1e-5})), 10)
    draws = [["0", "1"], ["0", "2"], ["0", "3"], ["4", "5"]]  # client 0: three times
    for drawn, most in zip(draws, (1, 2, 3, 3), strict=True):
        spent = ledger.account((drawn, 10), True)
        assert spent["epsilon"] == pytest.approx(reference_epsilon(
            dp_event.GaussianDpEvent(z / 2), NeighboringRelation.ADD_OR_REMOVE_ONE, most,
            1e-5), rel=1e-12)
    assert spent["clipped_fraction"] is None  # no clipped bit leaves a local-DP client


def test_a_round_that_would_pass_the_target_epsilon_is_not_run():
    """The check comes after the round's draw, with its real ratio: here the third round,
    whose 5 clients are drawn of only 5 eligible (no amplification), would pass the target
    that 5 of 10 would not have."""
    z, size = 1.0, 10
    ledger = population(PrivacyLedger(settings(**{"dp.noise-multiplier": z})), size)
    epsilons = []
    for eligible in (10, 10, 5, 10):
        epsilons.append(ledger.account(([str(i) for i in range(5)], eligible), True)["epsilon"])
    target = (epsilons[1] + epsilons[2]) / 2  # between rounds 2 and 3
    capped = population(PrivacyLedger(settings(**{"dp.noise-multiplier": z,
                                                  "dp.target-epsilon": target})), size)
    for _ in (1, 2):
        capped.check_budget(([str(i) for i in range(5)], 10))
        capped.account(([str(i) for i in range(5)], 10), True)
    with pytest.raises(BudgetSpentError) as spent:
        capped.check_budget(([str(i) for i in range(5)], 5))
    assert str(spent.value) == (f"dp.target-epsilon={target}: the next round would spend "
                                f"epsilon {epsilons[2]:.3f} at delta {default_delta(size):.3g}")


def test_the_privacy_state_survives_a_checkpoint(tmp_path):
    """Through the checkpoint's own format (``save_tree``/``load_tree``)."""
    run = settings(**{"dp.adaptive-clipping": True, "dp.clipped-count-stddev": 5.0})
    ledger = population(PrivacyLedger(run, rng=NoNoise()), 8)
    start = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    # its update unclipped: the clip norm moves down
    _, note = ledger.merge([reply("0", start, 0.0)], list(SHAPES), record(start), drawn=1)
    first = ledger.account((["0"], 8), True, note)
    save_tree(tmp_path / "checkpoint.npz", {"privacy": ledger.state()})
    restored = PrivacyLedger(run)
    restored.restore(load_tree(tmp_path / "checkpoint.npz")["privacy"])
    assert restored.clip_norm == ledger.clip_norm != run.dp_clip_norm
    assert restored.epsilon() == first["epsilon"] > 0


def test_the_population_is_never_fewer_than_the_clients_identified():
    """N, for the sampling ratio and the default delta: the clients' reported partitions,
    but sites that under-report cannot make it smaller than the clients the server knows."""
    ledger = PrivacyLedger(settings())
    ledger.fix_population({str(i): {"num-partitions": 2} for i in range(5)})
    assert ledger.population == 5 and ledger.delta() == default_delta(5)


def test_the_default_delta_is_at_most_1e_5_and_a_tenth_of_one_over_the_clients():
    """The chance the guarantee fails outright: far below one over the number of clients,
    and small in absolute terms; a delta the run config sets is at most 1e-3."""
    assert default_delta(1) == default_delta(10) == default_delta(10_000) == 1e-5
    assert default_delta(100_000) == pytest.approx(1e-6)
    assert population(PrivacyLedger(settings()), 20).delta() == 1e-5
    with pytest.raises(ConfigError, match=r"^dp\.delta: 0\.1 is out of range; allowed: \[0, "
                                          r"0\.001\]"):
        load_settings(app_config(**{"dp.mode": "central", "dp.delta": 0.1}))


def test_a_delta_not_far_below_one_over_the_clients_is_warned_about_once_at_the_preflight(
        caplog):
    """dp.delta = 1e-3 is a tenth of one over 100 clients (no warning), but one over 1,000:
    the chance the guarantee fails outright is then a client's own."""
    import logging

    caplog.set_level(logging.WARNING, logger="flwr")
    population(PrivacyLedger(settings(**{"dp.delta": 1e-3})), 100)
    assert "[privacy] dp.delta" not in caplog.text
    population(PrivacyLedger(settings(**{"dp.delta": 1e-3})), 1000)
    assert caplog.text.count("[privacy] dp.delta=0.001 is above 1 / (10 N) = 0.0001 for these "
                             "1000 clients") == 1


def test_a_mistake_that_shows_only_with_the_clients_stops_before_round_one():
    """Known at the preflight, not in a later round: a clipped-count noise too small for the
    noise multiplier."""
    with pytest.raises(ConfigError, match=r"dp\.clipped-count-stddev: with 10 clients a round"):
        population(PrivacyLedger(settings(**{"dp.adaptive-clipping": True,
                                              "dp.noise-multiplier": 1.5})), 10)


# ---------------------------------------------------------------------- configs
@pytest.mark.parametrize(("overrides", "line"), [
    ({"aggregation.rule": "trimmed-mean"}, "aggregation.rule='trimmed-mean' with "
     "dp.mode='central'"),
    ({"aggregation.clip-norm": 2.0}, "aggregation.clip-norm with dp.mode='central'"),
    ({"dp.mode": "local", "dp.adaptive-clipping": True}, "dp.adaptive-clipping with "
     "dp.mode='local'"),
    ({"method": "feddecomp", "feddecomp.weighting": "examples"},
     "feddecomp.weighting='examples' with dp.mode='central'"),
    ({"method": "factorized-fl"}, "dp.mode='central' is not available for method "
     "'factorized-fl'"),
    ({"method": "fedfac"}, "dp.mode='central' is not available for method 'fedfac'"),
    ({"method": "fedfac", "dp.mode": "local", "fedfac.new-clients": 0.2},
     "fedfac.new-clients with dp.mode"),
    ({"method": "pfedc", "dp.mode": "local", "pfedc.weighting": "counts"},
     "pfedc.weighting='counts' with dp.mode"),
    ({"method": "local", "dp.mode": "local"}, "dp.mode='local' is not available for method "
     "'local': it sends nothing"),
    ({"dp.noise-multiplier": 0.0}, "dp.noise-multiplier: 0.0 is out of range"),
])
def test_a_config_that_breaks_the_bound_is_refused_in_one_line(overrides, line):
    with pytest.raises(ConfigError) as refused:
        settings(**overrides)
    assert line in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("overrides", [
    {"method": "feddecomp"}, {"method": "fedrep"}, {"method": "fedbn"},
    {"method": "pfedc", "dp.mode": "local"}, {"method": "factorized-fl", "dp.mode": "local"},
    {"method": "fedfac", "dp.mode": "local"},
    {"dp.mode": "local", "aggregation.rule": "median"}])
def test_every_other_method_runs_under_dp(overrides):
    assert settings(**overrides).dp_mode in ("central", "local")


# ---------------------------------------------------------------------- the client
@pytest.mark.usefixtures("server_task")
@pytest.mark.parametrize("method", ["factorized-fl", "fedfac"])
def test_what_a_client_sends_but_never_gets_back_is_kept_as_it_was_sent(method):
    """Factorized-FL's matching vector ``v`` leaves every round and never comes back, and so
    do FedFac's personal rows in its dynamic mode. Under local DP the client keeps the noised
    value it sent: the next round's update of it is measured from a value the server has
    seen, never from the clean one (which would leave with the next update)."""
    overrides = {"dp.mode": "local", "local-epochs": 1}
    if method == "fedfac":
        overrides |= {"fedfac.mode": "dynamic"}
    client = make_client(0, app_config(method=method, **overrides))
    initial = initial_state(client.settings).arrays
    message = Message(RecordDict({ARRAYS: initial, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                      dst_node_id=100, message_type=MessageType.TRAIN)
    reply = train(message, client.context)
    assert not reply.has_error(), reply.error
    sent = reply.content[ARRAYS].to_torch_state_dict()
    model = client.model(ArrayRecord())  # its own state, nothing received
    kept = {k: v for k, v in model.state_dict().items() if k in sent}
    never_received = [k for k in sent if k not in initial or (method == "fedfac"
                      and k in client.wire.layer_of_key)]
    assert never_received
    for key in never_received:
        assert torch.equal(kept[key], sent[key]), key
