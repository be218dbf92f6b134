"""Trust boundaries (docs/security.md): every malformed reply is dropped by the one
validation path without stopping anything, influence on the shared model is bounded, and
state on disk is durable and loads without running code (client ids bound to nodes:
test_identity.py)."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from client_app.runtime import Client
from common.config import ConfigError
from common.durable import load_tree, save_tree
from common.protocol import (
    ARRAYS,
    CLIENT,
    CONFIG,
    EVALUATE_METRICS,
    METRICS,
    NUM_EXAMPLES,
    SERVER_ROUND,
    ReplyError,
)
from server_app.rounds import check_resumable
from strategies.engine import RoundEngine, RoundPlan
from strategies.engine.exchange import Exchange
from strategies.engine.replies import reason_of, valid_replies
from strategies.registry import REGISTRY, initial_state, load_settings
from tests.conftest import app_config, make_client

pytestmark = pytest.mark.usefixtures("server_task")


def _engine(method: str = "fedavg", **overrides):
    settings = load_settings(app_config(method=method, **overrides))
    initial, wire = initial_state(settings)
    return RoundEngine(settings, wire, REGISTRY[method].rule), initial


def _honest_reply(client: Client, arrays: ArrayRecord) -> tuple[Message, RecordDict]:
    message = Message(RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                      dst_node_id=client.context.node_id, message_type=MessageType.TRAIN)
    model = client.model(arrays)
    identity = client.identity()
    content = RecordDict({
        ARRAYS: client.shared_arrays(model, arrays, identity),
        METRICS: MetricRecord({NUM_EXAMPLES: len(client.data().y_train), "train-loss": 1.0,
                               "cpu-seconds": 0.5}),
        CLIENT: identity})
    return message, content


def _training(server_round: int, sent: list[Message], evaluating: list[Message] = (),
              evaluated: int | None = None) -> RoundPlan:
    """The plan of a round whose train messages were ``sent`` (``evaluating``: those that
    also carry round ``evaluated``'s evaluation)."""
    return RoundPlan(server_round, {m.metadata.dst_node_id: None for m in sent},
                     {m.metadata.dst_node_id: None for m in evaluating}, evaluated)


def _first(arrays: ArrayRecord) -> tuple[str, np.ndarray]:
    key = next(iter(arrays.keys()))
    return key, arrays[key].numpy()


def _set_array(content: RecordDict, make) -> None:
    key, value = _first(content[ARRAYS])
    content[ARRAYS][key] = make(value)


# Each case changes an honest train reply's content in place; the reason must mention `why`.
TRAIN_CASES = {
    "undecodable bytes": (lambda c: _set_array(c, lambda v: Array(
        str(v.dtype), v.shape, "numpy.ndarray", b"\x93NUMPY garbage")), "decode"),
    "not a numpy array": (lambda c: _set_array(c, lambda v: Array(
        str(v.dtype), v.shape, "torch.Tensor", Array(v).data)), "not a NumPy array"),
    "real shape differs": (lambda c: _set_array(c, lambda v: Array(
        str(v.dtype), v.shape, "numpy.ndarray", Array(v.reshape(-1)).data)), "data of shape"),
    "real dtype differs": (lambda c: _set_array(c, lambda v: Array(
        str(v.dtype), v.shape, "numpy.ndarray", Array(v.astype(np.float64)).data)),
        "float64 data"),
    "huge declared shape": (lambda c: _set_array(c, lambda v: Array(
        str(v.dtype), (10**9, 10**9), "numpy.ndarray", Array(v).data)), "shape"),
    "missing arrays": (lambda c: c[ARRAYS].pop(_first(c[ARRAYS])[0]), "missing"),
    "extra arrays": (lambda c: c[ARRAYS].__setitem__("evil", Array(np.zeros(3))), "unknown"),
    "list train-loss": (lambda c: c[METRICS].__setitem__("train-loss", [0.1, 0.2]),
                        "must be a number"),
    "list cpu-seconds": (lambda c: c[METRICS].__setitem__("cpu-seconds", [1.0]),
                         "must be a number"),
    "nan train-loss": (lambda c: c[METRICS].__setitem__("train-loss", math.nan), "not finite"),
    "no train-loss": (lambda c: c[METRICS].pop("train-loss"), "lack ['train-loss']"),
    "1e12 examples": (lambda c: c[METRICS].__setitem__(NUM_EXAMPLES, 10**12), "exceeds"),
    "superscript id": (lambda c: c[CLIENT].__setitem__("client-id", "\u00b2"), "safe id"),
    "path id": (lambda c: c[CLIENT].__setitem__("client-id", "../../etc/passwd"), "safe id"),
    "bytes id": (lambda c: c[CLIENT].__setitem__("client-id", b"\xff\xfe"), "string"),
    "no partition-id": (lambda c: c[CLIENT].pop("partition-id"), "partition-id"),
    "no metrics": (lambda c: c.pop(METRICS), "MetricRecord"),
    "padded payload": (lambda c: _set_array(c, lambda v: Array(
        str(v.dtype), v.shape, "numpy.ndarray", Array(v).data + bytes(10**6))), "bytes for"),
    "zero examples": (lambda c: c[METRICS].__setitem__(NUM_EXAMPLES, 0), "positive int"),
    "partition-id past the end": (lambda c: c[CLIENT].__setitem__(
        "partition-id", c[CLIENT]["num-partitions"]), "is not in"),
    "boolean partition-id": (lambda c: c[CLIENT].__setitem__("partition-id", True),
                             "must be ints"),
}


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_a_malformed_train_reply_is_dropped_and_the_others_pass(case):
    engine, initial = _engine()
    clients = [make_client(p, app_config()) for p in range(2)]
    sent, replies = [], []
    for client in clients:
        message, content = _honest_reply(client, initial)
        if client.partition_id == 1:
            TRAIN_CASES[case][0](content)
        sent.append(message)
        replies.append((client.context.node_id, Message(content, reply_to=message)))
    valid = engine.read(_training(1, sent), Exchange(sent, replies)).updates
    assert [r.client_id for r in valid] == ["0"]
    dropped = engine.ledger.record(1).dropped
    assert len(dropped) == 1 and dropped[0]["node"] == 101
    assert TRAIN_CASES[case][1] in dropped[0]["reason"], dropped[0]["reason"]
    assert "\n" not in dropped[0]["reason"] and "\n" not in dropped[0]["client"]
    # the checked arrays are the decoded values, ready for aggregation
    engine.rule.merge_updates(1, valid, initial)


def test_a_dropped_reply_is_told_in_its_checks_own_words_or_by_the_errors_type():
    assert reason_of(ReplyError("metrics lack ['loss']")) == "metrics lack ['loss']"
    assert reason_of(KeyError("w")) == 'KeyError: "\'w\'"'
    cut = reason_of(ValueError("x" * 1000))
    assert cut.startswith("ValueError: 'xxx") and cut.endswith("...") and len(cut) < 250


@pytest.mark.parametrize(("metric", "value"), [("accuracy", [0.5, 0.5]), ("loss", [1.0]),
                                               ("accuracy", 1.5), ("loss", -1.0),
                                               ("task-accuracy", 1.5),
                                               ("task-accuracy", [0.5])])
def test_a_malformed_evaluate_reply_is_dropped(metric, value):
    engine, _ = _engine()
    client = make_client(0, app_config())
    message = Message(RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: 1})}), dst_node_id=100,
                      message_type=MessageType.EVALUATE)
    metrics = {NUM_EXAMPLES: 10, "accuracy": 0.5, "loss": 1.0, metric: value}
    reply = Message(RecordDict({METRICS: MetricRecord(metrics), CLIENT: client.identity()}),
                    reply_to=message)
    valid = valid_replies(engine.ledger, engine.nodes, 1, "evaluate",
                          Exchange([message], [(100, reply)]), EVALUATE_METRICS, 1.0)
    assert valid == []
    assert metric in engine.ledger.record(1).dropped[0]["reason"]


@pytest.mark.parametrize("hostile", [
    lambda n: ["x"] * n, lambda n: [True] * n, lambda n: [0.0] * n,
    lambda n: [-1.0] + [1.0] * (n - 1), lambda n: [float("nan")] + [1.0] * (n - 1),
    lambda n: [1.0] * (n + 1)],
    ids=["strings", "booleans", "no-task-held", "negative", "nan", "one-too-many"])
def test_pfedc_task_weights_that_eq7_cannot_use_are_dropped(hostile):
    """A reply's task weights must be ``T`` finite non-negative numbers, not all zero: eq. 7
    weighs each branch's mean by them and ``held_keys`` reads which branches the reply must
    carry from them (a negative or all-zero vector would give negative weights or hold no
    branch; a wrong length would not say which task is which)."""
    engine, initial = _engine("pfedc")
    client = make_client(0, app_config(method="pfedc"))
    message, content = _honest_reply(client, initial)
    weights = list(content[CLIENT]["pfedc.task-weights"])
    content[CLIENT]["pfedc.task-weights"] = hostile(len(weights))
    valid = engine.read(_training(1, [message]), Exchange(
        [message], [(100, Message(content, reply_to=message))])).updates
    assert valid == []
    assert "pfedc.task-weights" in engine.ledger.record(1).dropped[0]["reason"]


def test_an_identify_reply_lacking_partition_entries_is_dropped_fedfac():
    """FedFac reads partition-id/num-partitions of identify replies: the envelope check
    drops a reply without them before ``on_identified`` sees it."""
    engine, _ = _engine("fedfac")
    message = Message(RecordDict({CONFIG: ConfigRecord({"action": "identify"})}),
                      dst_node_id=100, message_type=MessageType.QUERY)
    reply = Message(RecordDict({CLIENT: ConfigRecord({"client-id": "0"})}), reply_to=message)
    valid = engine.replies.valid(1, "identify", Exchange([message], [(100, reply)]), None)
    assert valid == [] and "partition-id" in engine.ledger.record(1).dropped[0]["reason"]
    assert engine.nodes.client_info == {}


# ---------------------------------------------------------------------- identity
def test_example_counts_are_pinned_at_the_first_report():
    engine, _ = _engine()
    client = make_client(0, app_config())
    for server_round, examples in ((1, 50), (2, 5000)):
        message = Message(RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                          dst_node_id=100, message_type=MessageType.EVALUATE)
        reply = Message(RecordDict({METRICS: MetricRecord({
            NUM_EXAMPLES: examples, "accuracy": 0.5, "loss": 1.0}), CLIENT: client.identity()}),
            reply_to=message)
        valid = engine.replies.valid(server_round, "evaluate",
                                     Exchange([message], [(100, reply)]), EVALUATE_METRICS)
        assert valid[0].num_examples == 50


def test_a_reply_claiming_more_than_max_num_examples_is_dropped():
    engine, _ = _engine(**{"aggregation.max-num-examples": 1000})
    message = Message(RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                      dst_node_id=100, message_type=MessageType.EVALUATE)
    reply = Message(RecordDict({METRICS: MetricRecord({NUM_EXAMPLES: 1001, "accuracy": 0.5,
                                                       "loss": 1.0}),
                                CLIENT: make_client(0, app_config()).identity()}),
                    reply_to=message)
    assert engine.replies.valid(1, "evaluate", Exchange([message], [(100, reply)]),
                                EVALUATE_METRICS) == []
    assert "aggregation.max-num-examples=1000" in engine.ledger.record(1).dropped[0]["reason"]


# ---------------------------------------------------------------------- durable state
def test_a_checkpoint_tree_round_trips_and_loads_no_pickle(tmp_path):
    tree = {"round": 3, "random": (3, tuple(range(5)), None), "arrays": {"w": np.eye(2)},
            "rule": {"personal": {"0": ArrayRecord({"b": Array(np.ones(3, np.float32))})},
                     "split": {"body.0": np.array([True, False])}}, "rounds": [{"x": 1.5}]}
    save_tree(tmp_path / "c.npz", tree)
    back = load_tree(tmp_path / "c.npz")
    assert back["random"] == tree["random"] and back["rounds"] == tree["rounds"]
    assert np.array_equal(back["arrays"]["w"], np.eye(2))
    assert np.array_equal(back["rule"]["personal"]["0"]["b"].numpy(), np.ones(3))
    assert back["rule"]["split"]["body.0"].dtype == bool
    np.savez(tmp_path / "evil.npz", __tree__=np.frombuffer(b"{}", np.uint8),
             a0=np.array([{"a": 1}, None], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        load_tree(tmp_path / "evil.npz")


def test_a_truncated_personal_state_falls_back_to_the_previous_round(tmp_path, caplog):
    config = app_config(method="fedper")
    client = make_client(0, config, **{"state-dir": str(tmp_path)})
    initial, _ = initial_state(client.settings)
    model = client.model(initial)
    client.keep_personal(model, initial, initial, server_round=1)
    first = {k: v.clone() for k, v in client.context.state["personal-state"]
             .to_torch_state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    client.keep_personal(model, initial, initial, server_round=2)
    path = tmp_path / "0.pt"
    path.write_bytes(path.read_bytes()[:100])  # a torn write
    fresh = make_client(0, config, **{"state-dir": str(tmp_path)})
    with caplog.at_level(logging.WARNING):
        state = fresh.personal_state(up_to_round=2)
    assert state and all(torch.equal(state[k], first[k]) for k in first)
    assert "does not load" in caplog.text and "previous round" in caplog.text
    # the next save does not move the broken file over the good previous one
    fresh.keep_personal(model, initial, initial, server_round=3)
    assert torch.load(tmp_path / "0.prev.pt", weights_only=True)["round"] == 1


def test_an_unsafe_client_id_in_the_node_config_is_refused():
    with pytest.raises(ConfigError, match="client-id"):
        make_client(0, app_config(), **{"client-id": "../x"})


def test_a_resume_with_another_run_config_is_refused_naming_the_keys():
    checkpoint = {"method": "fedavg", "config": app_config()}
    check_resumable(checkpoint, {**app_config(), "num-server-rounds": 20,
                                 "aggregation.rule": "median", "resume-from": "x",
                                 "evaluate-every": 10})
    with pytest.raises(ConfigError) as error:
        check_resumable(checkpoint, {**app_config(), "seed": 7, "dataset": "mnist"})
    message = str(error.value)
    assert "dataset ('digits' -> 'mnist'), seed (42 -> 7)" in message and "\n" not in message
    with pytest.raises(ConfigError, match="checkpoint is at round 5, past num-server-rounds=4"):
        check_resumable({**checkpoint, "round": 5}, {**app_config(), "num-server-rounds": 4})


@pytest.mark.parametrize(("key", "value", "message"), [
    ("lr", math.nan, "lr: nan is not a finite number"),
    ("aggregation.clip-norm", math.inf, "not a finite number"),
    ("plot", 1, "plot: expected bool"),
    ("permute-labels", "yes", "permute-labels: expected bool"),
    ("identity.require-registered", 0, "expected bool"),
    ("identity.node-owners", "a-b", "is not <node name>=<client id>"),
])
def test_config_rejects_non_finite_numbers_and_untyped_booleans(key, value, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(app_config(**{key: value}))


def test_the_evaluation_a_train_reply_carries_is_validated_on_its_own():
    """Fused evaluation: four evaluators' train replies carry ``eval-*`` metrics. One with an
    accuracy out of range and one with a list-valued accuracy are malformed replies: dropped
    for training and for the evaluation (each logged under its stage); one whose arrays are
    broken loses its training but its evaluation counts, as it would in the two-exchange
    protocol; the honest one counts in both."""
    engine, arrays = _engine()
    replies = []
    for partition, (evaluation, arrays_ok) in enumerate(
            [(0.75, True), (7.0, True), ([0.5, 0.5], True), (0.25, False)]):
        client = make_client(partition, app_config())
        message, content = _honest_reply(client, arrays)
        content[METRICS]["eval-accuracy"] = evaluation
        content[METRICS]["eval-num-examples"] = 20
        if not arrays_ok:
            _set_array(content, lambda v: Array(np.zeros((3, *v.shape), v.dtype)))
        replies.append((message, Message(content, reply_to=message)))
    sent = [m for m, _ in replies]
    read = engine.read(_training(2, sent, evaluating=sent, evaluated=1),
                       Exchange(sent, [(m.metadata.dst_node_id, r) for m, r in replies]))
    assert [r.client_id for r in read.updates] == ["0"]
    engine.evaluation.record_replies(1, read.evaluations, read.fused_evaluations)
    record = engine.ledger.record(1)
    assert record.eval["per_client"] == {"0": 0.75, "3": 0.25}
    reasons = {d["client"]: d["reason"] for d in record.dropped if d["stage"] == "evaluate"}
    assert "'eval-accuracy' = 7.0 is outside" in reasons["1"]
    assert "'eval-accuracy' must be a number" in reasons["2"]
    # each reply read once: one drop per job it failed, under the round of that job
    assert sorted(d["client"] for d in record.dropped) == ["1", "2"]
    trained = {d["client"]: d["reason"] for d in engine.ledger.record(2).dropped}
    assert sorted(trained) == ["1", "2", "3"] and "shape" in trained["3"]
