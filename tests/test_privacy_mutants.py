"""Tests that fail when privacy or trust weakens (issue #89, point 6): each guards against a
one-line change that an audit of single-line mutants found the suite did not notice.

- the DP noise comes from a secret generator: never the same twice, never the run's ``seed``
  (client side ``Client.privatized`` / ``privatize_uplink``; server side ``PrivacyLedger``);
- a round with fewer clients eligible is accounted at the sample size rounded *up*;
- the privacy spent (local and central) continues through the server's checkpoint, at unit
  level through ``save_checkpoint`` / ``load_checkpoint`` / ``resume``, and in one real
  resumed run (integration);
- example counts are pinned per client, not per node: a client that rejoins on a new node
  cannot raise its weight;
- one value that is not finite in one coordinate of one array drops the reply;
- the median and the trimmed mean are coordinate-wise.

Where a number needs a delta, ``dp.delta`` is set: the default delta is not relied on.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant as ReferenceAccountant
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from client_app.runtime import Client
from common.protocol import (
    ARRAYS,
    CLIENT,
    CONFIG,
    METRICS,
    NOT_FINITE,
    NUM_EXAMPLES,
    SERVER_ROUND,
    ClientReply,
    ReplyError,
    check_arrays,
)
from server_app.results import CHECKPOINT
from server_app.rounds import load_checkpoint, resume, save_checkpoint
from strategies.engine import RoundEngine, RoundPlan
from strategies.engine.exchange import Exchange
from strategies.engine.privacy import PrivacyLedger
from strategies.engine.robust import ExampleCounts, aggregate
from strategies.privacy import privatize_uplink, secret_rng
from strategies.registry import REGISTRY, initial_state, load_settings
from tests.conftest import REFERENCE, REFERENCE_CLIENTS, ROOT, app_config, read_results

SHAPES = {"conv.weight": (4, 3, 3, 3), "conv.bias": (4,), "fc.weight": (10, 36)}
DELTA = 1e-5  # explicit wherever a number depends on it


def arrays(rng: np.random.Generator, scale: float) -> dict[str, np.ndarray]:
    return {k: (rng.normal(size=shape) * scale).astype(np.float32)
            for k, shape in SHAPES.items()}


def record(values: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in values.items()})


def flat(values: ArrayRecord | dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(values[k].numpy() if isinstance(values, ArrayRecord)
                                      else values[k], np.float64).ravel() for k in SHAPES])


def dp_settings(mode: str, **overrides):
    return load_settings(app_config(**{"dp.mode": mode, "dp.noise-multiplier": 1.0,
                                       "dp.clip-norm": 1.0, "dp.delta": DELTA, **overrides}))


def with_population(ledger: PrivacyLedger, size: int) -> PrivacyLedger:
    ledger.fix_population({str(i): {"num-partitions": size} for i in range(size)})
    return ledger


def engine(method: str = "fedavg", **overrides) -> tuple[RoundEngine, ArrayRecord]:
    settings = load_settings(app_config(method=method, **overrides))
    initial, wire = initial_state(settings)
    return RoundEngine(settings, wire, REGISTRY[method].rule), initial


# ---------------------------------------------------------------------- (a) secret noise
def test_local_dp_noises_the_same_update_differently_every_time_whatever_the_seed():
    """A client privatizing the same update twice, and another ClientApp of the same run
    (same ``seed``, same partition) privatizing it once more, send three different uplinks:
    noise drawn from a fixed or seeded generator would repeat, and whoever knows the seed
    could subtract it. Each differs from the clean update by noise of the configured size."""
    config = app_config(**{"dp.mode": "local", "dp.noise-multiplier": 1.0,
                           "dp.clip-norm": 1.0})
    rng = np.random.default_rng(0)
    start = arrays(rng, 1.0)
    trained = {k: start[k] + 1e-3 * v for k, v in arrays(rng, 1.0).items()}  # not clipped
    client, twin = make_client_at(0, 100, config), make_client_at(0, 100, config)
    sent = [client.privatized(record(trained), record(start), ConfigRecord())[0],
            client.privatized(record(trained), record(start), ConfigRecord())[0],
            twin.privatized(record(trained), record(start), ConfigRecord())[0]]
    values = [flat(s) for s in sent]
    for i in range(3):
        for j in range(i + 1, 3):
            # (nearly) every coordinate differs: float32 may round two draws alike
            assert np.mean(values[i] != values[j]) > 0.99, (i, j)
    for value in values:  # noise of standard deviation z * C = 1.0 on every coordinate
        assert np.std(value - flat(trained)) == pytest.approx(1.0, rel=0.2)
    # the function itself, given the secret generator the client uses
    again = [flat(privatize_uplink(record(trained), record(start), "local", 1.0, 1.0,
                                   secret_rng())[0]) for _ in range(2)]
    assert np.mean(again[0] != again[1]) > 0.99


def make_client_at(partition: int, node_id: int, run_config: dict) -> Client:
    """A ClientApp ``Client`` of ``partition`` of 4 on node ``node_id``."""
    return Client.from_context(Context(
        run_id=1, node_id=node_id, node_config={"partition-id": partition,
                                                "num-partitions": 4},
        state=RecordDict(), run_config=run_config))


def central_merge(ledger: PrivacyLedger, start: dict[str, np.ndarray],
                  trained: dict[str, np.ndarray]) -> np.ndarray:
    replies = [ClientReply(100 + i, str(i), record(trained),
                           MetricRecord({NUM_EXAMPLES: 10}), ConfigRecord())
               for i in range(2)]
    return flat(ledger.merge(replies, list(SHAPES), record(start), drawn=2)[0])


def test_central_dp_noise_differs_between_ledgers_of_the_same_seed_and_between_rounds():
    """Two servers of the same run config (same ``seed``), each with its default generator,
    noise the same merge differently; one server noises two identical rounds differently.
    The noise on the mean of 2 clients has standard deviation z * C / 2 = 0.5."""
    run = dp_settings("central", seed=7)
    rng = np.random.default_rng(1)
    start = arrays(rng, 1.0)
    trained = {k: start[k] + 1e-3 * v for k, v in arrays(rng, 1.0).items()}
    first, second = (with_population(PrivacyLedger(run), 4) for _ in range(2))
    merged = [central_merge(first, start, trained), central_merge(second, start, trained),
              central_merge(first, start, trained)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert np.mean(merged[i] != merged[j]) > 0.99, (i, j)
    clean = flat(trained)
    for value in merged:
        assert np.std(value - clean) == pytest.approx(0.5, rel=0.2)


# ---------------------------------------------------------------------- (b) sample size
def sampled_epsilon(z: float, population: int, sample: int, delta: float) -> float:
    """dp-accounting's epsilon of one round: ``sample`` of ``population`` drawn without
    replacement, the accountant's noise multiplier half the run's (replace-one)."""
    accountant = ReferenceAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_event.SampledWithoutReplacementDpEvent(
        population, sample, dp_event.GaussianDpEvent(z / 2)))
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize(("drawn", "eligible", "accounted"), [
    (3, 7, 9),  # 3 * 20 / 7 = 8.57: up to 9, not down to 8
    (2, 9, 5),  # 2 * 20 / 9 = 4.44: up to 5, where rounding to the nearest gives 4
])
def test_a_round_with_fewer_clients_eligible_is_accounted_at_the_sample_rounded_up(
        drawn, eligible, accounted):
    """N = 20 clients, only ``eligible`` of them eligible, ``drawn`` drawn: the round's ratio
    is drawn / eligible, which N * ratio clients of N only match when rounded up (rounded
    down, the accountant would see a smaller ratio and report less epsilon than was
    spent). The budget check before the round sees the same."""
    z, size = 1.0, 20
    ledger = with_population(PrivacyLedger(dp_settings("central")), size)
    clients = [str(i) for i in range(drawn)]
    projected = ledger.epsilon((clients, eligible))
    ledger.check_budget((clients, eligible))
    spent = ledger.account((clients, eligible), True)["epsilon"]
    assert ledger.releases == {accounted: 1}
    assert spent == projected == pytest.approx(sampled_epsilon(z, size, accounted, DELTA),
                                               rel=1e-12)
    below = sampled_epsilon(z, size, accounted - 1, DELTA)
    assert accounted - 1 == math.floor(drawn * size / eligible)
    assert spent > below * (1 + 1e-6)


# ---------------------------------------------------------------------- (c) checkpoint
# round -> (clients drawn, of how many eligible); client 0 is drawn every round
DRAWS = [(["0", "1"], 4), (["0", "2"], 4), (["0", "3"], 4)]


def run_rounds_of(target: RoundEngine, draws) -> list[float]:
    spent = []
    for drawn, eligible in draws:
        target.privacy.check_budget((drawn, eligible))
        spent.append(target.privacy.account((drawn, eligible), True)["epsilon"])
    return spent


def clients_of(size: int) -> dict[str, dict[str, int]]:
    return {str(i): {"num-partitions": size} for i in range(size)}


@pytest.mark.usefixtures("server_task")
@pytest.mark.parametrize("mode", ["local", "central"])
def test_the_privacy_spent_continues_through_the_servers_checkpoint(mode, tmp_path):
    """Two rounds, the server's checkpoint (``save_checkpoint``: the engine's snapshot in
    ``checkpoint.npz``), a fresh engine resumed from it (``load_checkpoint``, ``resume``),
    then its preflight and round 3: every epsilon equals the uninterrupted run's. Local DP's
    per-client participation counts and central DP's releases and population are all in
    it: lost, round 3 would be accounted as if the run had started there."""
    overrides = {"dp.mode": mode, "dp.noise-multiplier": 1.0, "dp.delta": DELTA}
    uninterrupted, arrays_ = engine(**overrides)
    uninterrupted.privacy.fix_population(clients_of(4))
    expected = run_rounds_of(uninterrupted, DRAWS)
    assert 0 < expected[0] < expected[1] < expected[2]

    first, _ = engine(**overrides)
    first.privacy.fix_population(clients_of(4))
    assert run_rounds_of(first, DRAWS[:2]) == expected[:2]
    recorder = SimpleNamespace(rounds=[{"round": 1}, {"round": 2}])
    save_checkpoint(tmp_path / CHECKPOINT, 2, arrays_, first, recorder, ["run-1"])

    resumed, _ = engine(**overrides)
    next_round, _ = resume(load_checkpoint(tmp_path), resumed,
                           SimpleNamespace(rounds=[]))
    assert next_round == 3
    # the resumed run's preflight: fewer clients connected now, N stays the checkpoint's
    resumed.privacy.fix_population(clients_of(3))
    assert resumed.privacy.population == 4
    assert resumed.privacy.epsilon() == expected[1]
    assert run_rounds_of(resumed, DRAWS[2:]) == [expected[2]]


@pytest.mark.integration
def test_a_resumed_local_dp_run_continues_its_epsilon(federation, tmp_path):
    """A real local-DP run of 2 rounds, then resumed for a third: the resumed run's rounds 1-2
    are the first run's, and its third round's epsilon goes on from what the first run had
    spent by its end (its last evaluation included), past that of the 3 noised updates every
    client has now sent: restarted from nothing it would be that of round 3's releases
    alone, below both."""
    noise = 0.02  # the reference run's small model diverges under much more local noise
    config = {**REFERENCE, "method": "fedavg", "dp.mode": "local",
              "dp.noise-multiplier": noise, "dp.delta": DELTA}
    first_out, out = tmp_path / "first", tmp_path / "resumed"
    first = federation.run(ROOT, {**config, "num-server-rounds": 2,
                                  "output-dir": str(first_out)},
                           num_supernodes=REFERENCE_CLIENTS)
    assert first.ok, first.output[-3000:]
    resumed = federation.run(ROOT, {**config, "num-server-rounds": 3, "output-dir": str(out),
                                    "resume-from": str(first_out)},
                             num_supernodes=REFERENCE_CLIENTS)
    assert resumed.ok, resumed.output[-3000:]
    assert "[resume] from round 2" in resumed.output
    before, after = read_results(first_out), read_results(out)
    assert [r["privacy"] for r in after["rounds"][:2]] == \
        [r["privacy"] for r in before["rounds"]]
    third = after["rounds"][2]["privacy"]["epsilon"]
    accountant = ReferenceAccountant(neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE)
    accountant.compose(dp_event.GaussianDpEvent(noise / 2), 3)  # 3 updates, nothing else
    assert third > before["final"]["privacy"]["epsilon"] > 0
    assert third >= accountant.get_epsilon(DELTA) * (1 - 1e-9)
    assert after["final"]["privacy"]["epsilon"] == third


# ---------------------------------------------------------------------- (d) pinned counts
def train_reply(client: Client, arrays_: ArrayRecord, examples: int,
                break_arrays=None) -> tuple[Message, Message]:
    """A train message to ``client``'s node and its honest reply, claiming ``examples``
    (``break_arrays``: changes the uplink's arrays in place)."""
    message = Message(RecordDict({ARRAYS: arrays_, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                      dst_node_id=client.context.node_id, message_type=MessageType.TRAIN)
    identity = client.identity()
    uplink = client.shared_arrays(client.model(arrays_), arrays_, identity)
    if break_arrays is not None:
        break_arrays(uplink)
    content = RecordDict({ARRAYS: uplink, CLIENT: identity, METRICS: MetricRecord({
        NUM_EXAMPLES: examples, "train-loss": 1.0, "cpu-seconds": 0.5})})
    return message, Message(content, reply_to=message)


def read_train(target: RoundEngine, server_round: int, pairs: list[tuple[Message, Message]]
               ) -> list[ClientReply]:
    sent = [m for m, _ in pairs]
    plan = RoundPlan(server_round, {m.metadata.dst_node_id: None for m in sent}, {}, None)
    return target.read(plan, Exchange(sent, [(m.metadata.dst_node_id, r)
                                             for m, r in pairs])).updates


@pytest.mark.usefixtures("server_task")
def test_a_client_that_rejoins_on_a_new_node_keeps_its_pinned_example_count():
    """Client 0 reports 50 training examples from node 100; its node goes silent and it comes
    back on node 200 claiming 5000: it is weighted as 50 (pinned per client id, not per
    node, or a restart would raise a site's weight)."""
    target, initial = engine()
    config = app_config()
    [update] = read_train(target, 1, [train_reply(make_client_at(0, 100, config),
                                                  initial, 50)])
    assert (update.node_id, update.num_examples) == (100, 50)
    target.nodes.missed([100])  # the old node missed a message: the id may move
    [update] = read_train(target, 2, [train_reply(make_client_at(0, 200, config),
                                                  initial, 5000)])
    assert (update.node_id, update.client_id, update.num_examples) == (200, "0", 50)
    assert target.nodes.client_of(200) == "0"
    # the table itself, as the engine uses it for both stages
    counts = ExampleCounts()
    for node, examples in ((100, 50), (200, 5000), (300, 49)):
        [bounded] = counts.bound("evaluate", [ClientReply(node, "0", ArrayRecord(),
                                                          MetricRecord({NUM_EXAMPLES: examples}),
                                                          ConfigRecord())])
        assert bounded.num_examples == min(examples, 50)
    assert list(counts.pinned) == ["0"]


# ---------------------------------------------------------------------- (e) one NaN
def set_one(value: float, index: int):
    """Puts ``value`` in coordinate ``index`` (flat) of the uplink's last array only."""
    def change(uplink: ArrayRecord) -> None:
        key = list(uplink.keys())[-1]
        values = uplink[key].numpy().copy()
        values.flat[index] = value
        uplink[key] = Array(values)
    return change


@pytest.mark.usefixtures("server_task")
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_one_value_not_finite_in_one_coordinate_drops_the_reply(value):
    """One coordinate (neither the first nor the last) of one array of client 1's update is
    not finite, every other value honest: that reply is dropped with its reason, naming the
    array and saying "not finite" (what tells a diverged run); client 0's passes."""
    target, initial = engine()
    config = app_config()
    clients = [make_client_at(p, 100 + p, config) for p in range(2)]
    last = list(initial.keys())[-1]
    index = initial[last].numpy().size // 2
    pairs = [train_reply(clients[0], initial, 50),
             train_reply(clients[1], initial, 50, set_one(value, index))]
    assert [r.client_id for r in read_train(target, 1, pairs)] == ["0"]
    [dropped] = target.ledger.record(1).dropped
    assert dropped["node"] == 101 and dropped["client"] == "1"
    assert NOT_FINITE in dropped["reason"] and repr(last) in dropped["reason"]
    # the check itself, on a float64 array of 1000 values with one of them not finite
    spec = {"w": ((10, 100), "float64"), "b": ((3,), "float32")}
    honest = {"w": np.zeros((10, 100)), "b": np.zeros(3, np.float32)}
    check_arrays(record(honest), spec)
    honest["w"][7, 31] = value
    with pytest.raises(ReplyError, match=f"'w' has values that are {NOT_FINITE}"):
        check_arrays(record(honest), spec)


# ---------------------------------------------------------------------- (f) coordinate-wise
def robust_reply(i: int, values: dict[str, np.ndarray]) -> ClientReply:
    return ClientReply(100 + i, str(i), record({k: v.astype(np.float32)
                                                for k, v in values.items()}),
                       MetricRecord({NUM_EXAMPLES: 10 ** i}), ConfigRecord())


def test_the_median_is_taken_coordinate_by_coordinate():
    """Three clients whose coordinate-wise median is none of their arrays (client 1 holds
    the median of two coordinates of ``w``, client 2 of the other two), nor the median of
    all their values (5.5), nor their (example-weighted or plain) mean; each array on its
    own."""
    settings = load_settings(app_config(**{"aggregation.rule": "median"}))
    uploads = [{"w": np.array([[1, 50], [9, 0]]), "b": np.array([0, 10, -1])},
               {"w": np.array([[2, 3], [7, 4]]), "b": np.array([5, 0, -2])},
               {"w": np.array([[30, 4], [8, 20]]), "b": np.array([1, 1, 100])}]
    reference = record({"w": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)})
    merged = aggregate([robust_reply(i, u) for i, u in enumerate(uploads)], ["w", "b"],
                       reference, settings)
    np.testing.assert_array_equal(merged["w"].numpy(), np.array([[2, 4], [8, 4]], np.float32))
    np.testing.assert_array_equal(merged["b"].numpy(), np.array([1, 1, -1], np.float32))
    assert merged["w"].numpy().dtype == np.float32


def test_the_trimmed_mean_cuts_each_coordinate_on_its_own():
    """Five clients, ``trim-fraction`` 0.2: each coordinate loses its own lowest and highest
    value (a different client's in each) and averages the middle three; not the median (2
    and 5 where the trimmed mean is 3 and 6), not the mean, not whole clients cut."""
    settings = load_settings(app_config(**{"aggregation.rule": "trimmed-mean",
                                           "aggregation.trim-fraction": 0.2}))
    rows = [[100, 0, 1, 2], [1, 100, 2, 3], [2, 1, 100, 10], [6, 5, 3, 100],
            [-100, 3, -100, 5]]
    reference = record({"w": np.zeros((2, 2), np.float32)})
    merged = aggregate([robust_reply(i, {"w": np.array(r).reshape(2, 2)})
                        for i, r in enumerate(rows)], ["w"], reference, settings)
    np.testing.assert_array_equal(merged["w"].numpy(), np.array([[3, 3], [2, 6]], np.float32))
