"""Every method's wire spec is one declaration used by both sides: a client's reply built from
it passes the server's validation with no drop, in every state of the method (FedFac before
and after its split, pFedC clients holding only some classes, both Factorized-FL variants)."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
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
    NUM_EXAMPLES,
    SERVER_ROUND,
    TRAIN_METRICS,
)
from strategies.engine.exchange import Exchange
from strategies.engine.replies import valid_replies
from strategies.registry import REGISTRY, initial_state
from tests.conftest import app_config, make_client

pytestmark = pytest.mark.usefixtures("server_task")


SCENARIOS = [
    *[(m, {}) for m in REGISTRY],
    ("pfedc", {"partitioner": "pathological", "classes-per-client": 2}),
    ("pfedc", {"partitioner": "pathological", "pfedc.weighting": "counts", "pfedc.tasks": 3}),
    ("factorized-fl", {"factorized-fl.variant": "uvm"}),
    ("factorized-fl", {"factorized-fl.variant": "u-paper"}),
    ("feddecomp", {"feddecomp.bn-stats": "personal", "feddecomp.weighting": "examples"}),
    ("fedfac", {"fedfac.mode": "dynamic", "fedfac.layers": "0,1"}),
]


def _round_trip(strategy, clients: list[Client], server_round: int, arrays: ArrayRecord
                ) -> tuple[list, list]:
    """Each client receives its downlink and replies with what its wire spec builds; the
    server validates the replies exactly as in a round."""
    strategy.begin_round(server_round)
    sent, replies = [], []
    for client in clients:
        down = strategy.downlink(server_round, client.client_id, arrays)
        message = Message(RecordDict({ARRAYS: down, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                          dst_node_id=client.context.node_id, message_type=MessageType.TRAIN)
        model = client.model(down)
        identity = client.identity()
        reply = Message(RecordDict({
            ARRAYS: client.shared_arrays(model, down, identity),
            METRICS: MetricRecord({NUM_EXAMPLES: len(client.data().y_train), "train-loss": 1.0}),
            CLIENT: identity}), reply_to=message)
        sent.append(message)
        replies.append((client.context.node_id, reply))
    masks = strategy.uplink_masks()
    valid = valid_replies(strategy.ledger, strategy.nodes, server_round, "train",
                          Exchange(sent, replies), TRAIN_METRICS, 1.0,
                          lambda r: strategy.wire.uplink_spec(r.info, masks))
    return valid, strategy.ledger.record(server_round).dropped


@pytest.mark.parametrize(("method", "overrides"), SCENARIOS,
                         ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}"
                              for m, o in SCENARIOS])
def test_replies_built_from_the_wire_spec_pass_validation(method, overrides):
    run_config = app_config(method=method, **overrides)
    clients = [make_client(p, run_config) for p in range(4)]
    settings = clients[0].settings
    initial, wire = initial_state(settings)
    strategy = REGISTRY[method].strategy(settings, initial, wire)
    arrays = initial
    for server_round in (1, 2, 3):  # before and after per-client tables and FedFac's split
        valid, dropped = _round_trip(strategy, clients, server_round, arrays)
        assert dropped == []
        assert [r.client_id for r in valid] == ["0", "1", "2", "3"]
        arrays = strategy.aggregate_train(server_round, valid, arrays)
    if method == "fedfac":
        assert strategy.split is not None
    if method == "pfedc" and overrides:
        # clients holding some classes only: their uplinks lack the other branches
        assert any(len(r.arrays) < len(initial) for r in valid)


def test_a_reply_that_breaks_the_wire_spec_is_dropped():
    """The same path drops what the spec does not allow (here: a pFedC client claiming a task
    it sends no branch for)."""
    run_config = app_config(method="pfedc", partitioner="pathological")
    client = make_client(0, run_config)
    initial, wire = initial_state(client.settings)
    strategy = REGISTRY["pfedc"].strategy(client.settings, initial, wire)
    identity = client.identity()
    weights = identity["pfedc.task-weights"]
    lying = ConfigRecord({**identity, "pfedc.task-weights": [1.0] * len(weights)})
    model = client.model(initial)
    message = Message(RecordDict({ARRAYS: initial, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                      dst_node_id=100, message_type=MessageType.TRAIN)
    reply = Message(RecordDict({
        ARRAYS: client.shared_arrays(model, initial, identity),
        METRICS: MetricRecord({NUM_EXAMPLES: 5, "train-loss": 1.0}), CLIENT: lying}),
        reply_to=message)
    valid = valid_replies(strategy.ledger, strategy.nodes, 1, "train",
                          Exchange([message], [(100, reply)]), TRAIN_METRICS, 1.0,
                          lambda r: wire.uplink_spec(r.info, None))
    assert valid == []
    assert "missing" in strategy.ledger.record(1).dropped[0]["reason"]
    assert np.count_nonzero(weights) < len(weights)
