"""Under ``dp.mode = "local"`` nothing exact that a client's data decides leaves it
(docs/privacy.md#what-leaves-a-client): every reply of every method's ClientApp (the identify
query, a train message with the last round's evaluation fused in, an evaluate message, an
error) is read here key by key, through the real handlers and real Flower messages."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from client_app.app import evaluate_personalized, query, train
from client_app.runtime import Client
from common.protocol import (
    ACTION,
    ARRAYS,
    CLIENT,
    CLIENT_ID,
    CONFIG,
    EVAL_ACCURACY,
    EVAL_EXAMPLES,
    EVAL_TASK_ACCURACY,
    EVALUATE_FIRST,
    EXACT_EVALUATION,
    IDENTIFY,
    METRICS,
    NUM_EXAMPLES,
    NUM_PARTITIONS,
    PARTITION_ID,
    SERVER_ROUND,
    TASK_ACCURACY,
)
from strategies.privacy import LOCAL_DP_FIXED, LOCAL_DP_NOISED
from strategies.registry import REGISTRY, initial_state, load_settings
from tests.conftest import app_config

pytestmark = pytest.mark.usefixtures("server_task")
METHODS = sorted(m for m in REGISTRY if m != "local")  # local sends nothing: refused
# what a reply may carry under local DP: noised scores, example counts fixed at 1
RELEASED = {*LOCAL_DP_NOISED, *LOCAL_DP_FIXED}


def context(method: str, **node) -> Context:
    run_config = app_config(**{"method": method, "dp.mode": "local", "local-epochs": 2,
                               "dp.noise-multiplier": 0.1})  # scores seldom cut to 0 or 1
    return Context(run_id=1, node_id=100, state=RecordDict(), run_config=run_config,
                   node_config={"partition-id": 0, "num-partitions": 4, **node})


def message(kind: str, content: RecordDict) -> Message:
    return Message(content, dst_node_id=100, message_type=kind)


def replies(method: str, **node) -> dict[str, Message]:
    """The method's ClientApp's replies to identify, to a train message that carries the
    last round's evaluation, and to an evaluate message."""
    ctx = context(method, **node)
    arrays = initial_state(load_settings(dict(ctx.run_config))).arrays
    done = {
        "identify": query(message(MessageType.QUERY, RecordDict(
            {CONFIG: ConfigRecord({ACTION: IDENTIFY})})), ctx),
        "train": train(message(MessageType.TRAIN, RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord(
            {SERVER_ROUND: 2, EVALUATE_FIRST: True})})), ctx),
        "evaluate": evaluate_personalized(message(MessageType.EVALUATE, RecordDict(
            {ARRAYS: arrays, CONFIG: ConfigRecord({SERVER_ROUND: 2})})), ctx)}
    for kind, reply in done.items():
        assert not reply.has_error(), (kind, reply.error)
    return done


@pytest.mark.parametrize("method", METHODS)
def test_no_reply_of_any_method_carries_an_exact_data_dependent_value(method):
    """Every metric is a noised score or a count fixed at 1, two replies to the same
    message carry different scores, and the identity record says who the client is and
    nothing of its data (pFedC claims every task: which classes it holds stays home)."""
    first, second = replies(method), replies(method)
    for kind in ("train", "evaluate"):
        metrics = dict(first[kind].content[METRICS])
        assert set(metrics) <= RELEASED, (kind, sorted(set(metrics) - RELEASED))
        assert all(metrics[k] == 1 for k in LOCAL_DP_FIXED if k in metrics)
        scores = [k for k in LOCAL_DP_NOISED if k in metrics]
        assert scores, kind
        again = dict(second[kind].content[METRICS])
        assert any(metrics[k] != again[k] for k in scores), (kind, metrics, again)
    assert {EVAL_ACCURACY, EVAL_TASK_ACCURACY, EVAL_EXAMPLES} <= set(
        first["train"].content[METRICS])
    assert "train-loss" not in first["train"].content[METRICS]
    for kind, reply in first.items():
        info = dict(reply.content[CLIENT])
        extra = set(info) - {CLIENT_ID, PARTITION_ID, NUM_PARTITIONS}
        assert extra <= {"pfedc.task-weights"}, (kind, extra)
        if extra:
            assert set(info["pfedc.task-weights"]) == {1.0}


def test_a_site_that_opts_in_sends_its_exact_scores_flagged():
    """``dp-exact-evaluation = true`` in a site's node config: its scores leave exact (what
    the same model scores without DP), flagged so that the server names the site instead of
    accounting them; the counts stay 1 and the rest stays withheld."""
    ctx = context("fedavg", **{EXACT_EVALUATION: True})
    arrays = initial_state(load_settings(dict(ctx.run_config))).arrays
    config = ConfigRecord({SERVER_ROUND: 2})
    exact = evaluate_personalized(message(MessageType.EVALUATE, RecordDict(
        {ARRAYS: arrays, CONFIG: config})), ctx).content[METRICS]
    client = Client.from_context(context("fedavg"))  # a site that did not opt in, unasked
    scored = client.evaluate(client.model(arrays, 2, config), 2)
    assert dict(exact) == {NUM_EXAMPLES: 1, "accuracy": scored.accuracy,
                           TASK_ACCURACY: scored.task_accuracy, EXACT_EVALUATION: 1.0}


def test_an_error_reply_names_its_type_only_unless_it_is_about_settings():
    """A handler that fails on something its data made says only what kind of error it
    was; a settings problem (a ``ConfigError``: the run's or the site's keys) keeps its
    line, so that a run every site refuses still stops with the reason."""
    ctx = context("fedavg")
    broken = train(message(MessageType.TRAIN, RecordDict(
        {CONFIG: ConfigRecord({SERVER_ROUND: 1})})), ctx)  # no arrays: a KeyError inside
    assert broken.has_error()
    assert broken.error.reason.endswith(": its message stays on the site under "
                                        "dp.mode='local' (the site's log has it)")
    assert broken.error.reason.split(":", 1)[0].isidentifier()
    refused = query(message(MessageType.QUERY, RecordDict(
        {CONFIG: ConfigRecord({ACTION: IDENTIFY})})),
        Context(run_id=1, node_id=100, state=RecordDict(), run_config=dict(ctx.run_config),
                node_config={"partition-id": 0}))
    assert refused.error.reason.startswith("ConfigError: node config: partition-id and "
                                           "num-partitions are required")
