"""One round's exchange read once (``strategies/engine/round_plan.py: read_round``): each
reply serves its jobs (a train update; an evaluator's evaluation of the last round), is
dropped from each job it fails under that job's round, and speaks for its client id only
when it serves one (the loop that runs the rounds: test_round_loop.py)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from common.protocol import ARRAYS, CLIENT, CONFIG, METRICS, NUM_EXAMPLES, SERVER_ROUND
from common.record import RoundRecord
from strategies.engine import RoundPlan
from strategies.engine.exchange import Exchange
from strategies.engine.replies import DivergenceWatch, RunFailedError
from tests.conftest import app_config, make_client
from tests.test_trust import _engine

pytestmark = pytest.mark.usefixtures("server_task")


def _train_reply(partition: int, arrays: ArrayRecord, arrays_ok: bool,
                 evaluation: dict[str, float | int], examples: int = 50,
                 node_id: int | None = None) -> tuple[Message, Message]:
    """Round 2's train message to partition ``partition``'s node (or to ``node_id``) and its
    reply: its honest update (or one with a broken array), ``examples`` training examples
    and ``evaluation`` (``eval-*`` metrics)."""
    client = make_client(partition, app_config())
    message = Message(RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({SERVER_ROUND: 2})}),
                      dst_node_id=client.context.node_id if node_id is None else node_id,
                      message_type=MessageType.TRAIN)
    uplink = client.shared_arrays(client.model(arrays), arrays, client.identity())
    if not arrays_ok:
        key = next(iter(uplink.keys()))
        uplink[key] = Array(np.zeros((3, *uplink[key].numpy().shape), np.float32))
    return message, Message(RecordDict({
        ARRAYS: uplink, CLIENT: client.identity(),
        METRICS: MetricRecord({NUM_EXAMPLES: examples, "train-loss": 1.0, **evaluation})}),
        reply_to=message)


EVALUATION = {"eval-accuracy": 0.5, "eval-num-examples": 20}


def test_a_reply_speaks_for_its_client_only_when_it_serves_a_job():
    """Node 100: broken arrays, no evaluation asked; 101: broken arrays, a valid evaluation;
    102: broken arrays and no evaluation although asked; 103: honest, evaluating."""
    engine, arrays = _engine()
    exchanged = [_train_reply(0, arrays, False, {}), _train_reply(1, arrays, False, EVALUATION),
                 _train_reply(2, arrays, False, {}), _train_reply(3, arrays, True, EVALUATION)]
    sent = [m for m, _ in exchanged]
    plan = RoundPlan(2, {m.metadata.dst_node_id: None for m in sent},
                     {101: None, 102: None, 103: None}, 1)
    read = engine.read(plan, Exchange(sent, [(m.metadata.dst_node_id, r)
                                             for m, r in exchanged]))
    assert [r.client_id for r in read.updates] == ["3"]
    assert [r.client_id for r in read.fused_evaluations] == ["1", "3"]
    assert engine.nodes.node_to_client == {101: "1", 103: "3"}  # 100 and 102 served nothing
    train = sorted((d["client"], d["reason"]) for d in engine.ledger.record(2).dropped)
    assert [c for c, _ in train] == ["0", "1", "2"] and all("shape" in r for _, r in train)
    evaluate = engine.ledger.record(1).dropped  # each job dropped once
    assert [d["client"] for d in evaluate] == ["2"] and "eval-accuracy" in evaluate[0]["reason"]


def test_a_missing_node_is_dropped_from_each_of_its_jobs_and_every_reply_counts_its_bytes():
    """Node 100 trains (broken arrays), 101 trains and evaluates, 102 only evaluates (an
    evaluate message in the same exchange); 101 and 102 do not reply."""
    engine, arrays = _engine()
    (sent_0, reply_0), (sent_1, _) = (_train_reply(0, arrays, False, {}),
                                      _train_reply(1, arrays, True, EVALUATION))
    sent_2 = Message(RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                     dst_node_id=102, message_type=MessageType.EVALUATE)
    plan = RoundPlan(2, {100: None, 101: None}, {101: None, 102: None}, 1)
    read = engine.read(plan, Exchange([sent_0, sent_1, sent_2], [(100, reply_0)]))
    assert read.updates == read.fused_evaluations == read.evaluations == []
    train = sorted((d["node"], d["reason"]) for d in engine.ledger.record(2).dropped)
    assert [node for node, _ in train] == [100, 101] and "no reply" in train[1][1]
    # round 1's evaluation: the evaluate-only node first, then the evaluating trainer
    evaluate = engine.ledger.record(1).dropped
    assert [(d["node"], d["stage"]) for d in evaluate] == [(102, "evaluate"), (101, "evaluate")]
    # a dropped reply's arrays crossed the wire all the same
    assert engine.ledger.record(2).bytes_up == reply_0.content[ARRAYS].count_bytes()


def test_a_plan_splits_its_evaluators_into_trainers_and_the_others():
    plan = RoundPlan(2, {1: "a", 2: "b"}, {2: "b", 3: "c"}, 1)
    assert plan.evaluating_trainers() == {2}  # its train message carries the evaluation
    assert plan.evaluating_only() == {3: "c"}


def test_a_round_weighs_each_client_by_its_first_reported_example_counts():
    """Example counts are pinned at a client's first report (``robust.ExampleCounts``), for
    its update and for the evaluation its train reply carries, in a round's exchange too."""
    engine, arrays = _engine()
    for examples, tested in ((50, 20), (5000, 2000)):
        sent, reply = _train_reply(0, arrays, True, {"eval-accuracy": 0.5,
                                                     "eval-num-examples": tested}, examples)
        read = engine.read(RoundPlan(2, {100: None}, {100: None}, 1),
                           Exchange([sent], [(100, reply)]))
        assert [r.num_examples for r in read.updates] == [50]
        assert [r.num_examples for r in read.fused_evaluations] == [20]


def test_the_evaluation_a_train_reply_carries_keeps_its_task_accuracy_and_cpu_time():
    engine, arrays = _engine()
    sent, reply = _train_reply(0, arrays, True, {**EVALUATION, "eval-task-accuracy": 0.25,
                                                 "eval-cpu-seconds": 1.5})
    read = engine.read(RoundPlan(2, {100: None}, {100: None}, 1),
                       Exchange([sent], [(100, reply)]))
    engine.evaluation.record_replies(1, read.evaluations, read.fused_evaluations)
    record = engine.ledger.record(1)
    assert record.eval["accuracy_weighted"] == 0.5 and record.eval["accuracy_task_mean"] == 0.25
    assert record.cpu_seconds["clients_evaluate"] == 1.5


def test_an_evaluation_of_no_examples_is_dropped_and_the_update_kept():
    engine, arrays = _engine()
    sent, reply = _train_reply(0, arrays, True, {"eval-accuracy": 0.5, "eval-num-examples": 0})
    read = engine.read(RoundPlan(2, {100: None}, {100: None}, 1),
                       Exchange([sent], [(100, reply)]))
    assert [r.client_id for r in read.updates] == ["0"] and read.fused_evaluations == []
    (dropped,) = engine.ledger.record(1).dropped
    assert dropped["stage"] == "evaluate" and "eval-num-examples" in dropped["reason"]


def test_a_bound_nodes_reply_that_serves_no_job_is_dropped_under_the_id_it_holds():
    """Node 100 holds client 0; its broken reply claims client 1: the drop names client 0,
    and the claim binds nothing."""
    engine, arrays = _engine()
    assert engine.nodes.claim(100, "0", 1) is None
    sent, reply = _train_reply(1, arrays, False, {}, node_id=100)
    engine.read(RoundPlan(2, {100: "0"}, {}, None), Exchange([sent], [(100, reply)]))
    (dropped,) = engine.ledger.record(2).dropped
    assert dropped["client"] == "0" and "shape" in dropped["reason"]
    assert engine.nodes.node_to_client == {100: "0"}


def test_a_node_that_did_not_reply_no_longer_holds_its_id_against_a_new_node():
    """Node 100 holds client 0 and misses round 2; in round 3 node 200 speaks for client 0
    (the client came back on another node): it is heard. Had 100 answered, it would not be."""
    for answered in (False, True):
        engine, arrays = _engine()
        assert engine.nodes.claim(100, "0", 1) is None
        sent, reply = _train_reply(0, arrays, True, {}, node_id=100)
        engine.read(RoundPlan(2, {100: "0"}, {}, None),
                    Exchange([sent], [(100, reply)] if answered else []))
        sent, reply = _train_reply(0, arrays, True, {}, node_id=200)
        read = engine.read(RoundPlan(3, {200: None}, {}, None), Exchange([sent], [(200, reply)]))
        assert [r.client_id for r in read.updates] == ([] if answered else ["0"])
        assert engine.nodes.client_of(200) == (None if answered else "0")


def _dropped(*drops: tuple[int, str, str]) -> RoundRecord:
    """A round's record with (node, stage, reason) drops."""
    return RoundRecord(dropped=[{"stage": stage, "node": node, "client": str(node),
                                 "reason": reason} for node, stage, reason in drops])


NAN_LOSS = "metric 'train-loss' is not finite"
NAN_ARRAY = "'w' has values that are not finite"


def test_a_run_stops_as_diverged_after_three_rounds_of_only_non_finite_training():
    """Three rounds in a row with no update accepted and at least min-nodes nodes dropped
    from training as not finite. One node sending NaN (a hostile or broken site), a round
    with an update accepted, nodes that timed out or whose evaluation alone was not finite,
    never stop a run; a node dropped twice counts once."""
    watch = DivergenceWatch(min_nodes=2)
    for server_round in range(1, 4):  # one node only, twice (its update, its evaluation)
        watch.after_round(server_round, _dropped((7, "train", NAN_LOSS),
                                                 (7, "train", NAN_ARRAY)), accepted=0)
    for server_round in range(4, 7):  # timeouts and evaluations do not count
        watch.after_round(server_round, _dropped(
            (1, "train", NAN_LOSS), (2, "train", "no reply within round-timeout"),
            (3, "evaluate", "metric 'eval-loss' is not finite")), accepted=0)
    both = _dropped((1, "train", NAN_LOSS), (2, "train", NAN_ARRAY))
    watch.after_round(7, both, accepted=0)
    watch.after_round(8, both, accepted=0)
    watch.after_round(9, both, accepted=1)  # an update got through: the count starts again
    watch.after_round(10, both, accepted=0)
    watch.after_round(11, both, accepted=0)
    with pytest.raises(RunFailedError, match=r"^rounds 10-12: .* 2 dropped in round 12 as "
                                             r"not finite: the run diverged$"):
        watch.after_round(12, both, accepted=0)
