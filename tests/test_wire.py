"""Every method's wire spec is one declaration used by both sides: a client's reply built from
it passes the server's validation with no drop, in every state of the method (FedFac before
and after its split, pFedC clients holding only some classes, both Factorized-FL variants)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
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
)
from models.factorized_fl import matching_key
from models.pfedc import branch_of_key
from strategies.engine import RoundEngine, RoundPlan
from strategies.engine.exchange import Exchange
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
    # under differential privacy: the clipped (and, local, noised) uplinks
    *[(m, {"dp.mode": "local"}) for m in REGISTRY if m != "local"],
    *[(m, {"dp.mode": "central"}) for m in ("fedavg", "fedbn", "feddecomp", "ditto", "fedala")],
    ("fedfac", {"dp.mode": "local", "fedfac.mode": "dynamic", "fedfac.layers": "0,1"}),
]


def _round_trip(strategy, clients: list[Client], server_round: int, arrays: ArrayRecord
                ) -> tuple[list, list]:
    """Each client receives its downlink and replies with what its wire spec builds; the
    server validates the replies exactly as in a round."""
    sent, replies = [], []
    for client in clients:
        down = strategy.rule.downlink(server_round, client.client_id, arrays)
        message = Message(RecordDict({ARRAYS: down, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                          dst_node_id=client.context.node_id, message_type=MessageType.TRAIN)
        model = client.model(down)
        identity = client.identity()
        uplink, privacy = client.shared_arrays(model, down, identity), {}
        if client.settings.dp_mode:  # untrained: every update is zero, and stays zero
            uplink, privacy = client.privatized(uplink, uplink, message.content[CONFIG])
        reply = Message(RecordDict({
            ARRAYS: uplink,
            METRICS: MetricRecord({NUM_EXAMPLES: len(client.data().y_train), "train-loss": 1.0,
                                   **privacy}),
            CLIENT: identity}), reply_to=message)
        sent.append(message)
        replies.append((client.context.node_id, reply))
    plan = RoundPlan(server_round, {m.metadata.dst_node_id: None for m in sent}, {}, None)
    valid = strategy.read(plan, Exchange(sent, replies)).updates
    return valid, strategy.ledger.record(server_round).dropped


def _three_rounds(method: str, overrides: dict):
    """Rounds 1-3 of ``method`` with four clients, each round's replies validated as in a
    run (before and after per-client tables and FedFac's split): yields the round, the
    strategy, the clients, the valid replies and the dropped ones; aggregates after each."""
    run_config = app_config(method=method, **overrides)
    clients = [make_client(p, run_config) for p in range(4)]
    settings = clients[0].settings
    initial, wire = initial_state(settings)
    strategy = RoundEngine(settings, wire, REGISTRY[method].rule)
    arrays = initial
    for server_round in (1, 2, 3):
        valid, dropped = _round_trip(strategy, clients, server_round, arrays)
        yield server_round, strategy, clients, valid, dropped
        arrays = strategy.rule.merge_updates(server_round, valid, arrays)


@pytest.mark.parametrize(("method", "overrides"), SCENARIOS,
                         ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}"
                              for m, o in SCENARIOS])
def test_replies_built_from_the_wire_spec_pass_validation(method, overrides):
    rounds = list(_three_rounds(method, overrides))
    for _, _, _, valid, dropped in rounds:
        assert dropped == []
        assert [r.client_id for r in valid] == ["0", "1", "2", "3"]
    _, strategy, clients, valid, _ = rounds[-1]
    initial = initial_state(clients[0].settings).arrays
    if method == "fedfac":
        assert strategy.rule.split is not None
    if method == "pfedc" and overrides.get("dp.mode") == "local":
        # which classes a client holds stays home: every client claims and sends every branch
        assert all(len(r.arrays) == len(initial) for r in valid)
    elif method == "pfedc" and overrides:
        # clients holding some classes only: their uplinks lack the other branches
        assert any(len(r.arrays) < len(initial) for r in valid)


def test_a_reply_that_breaks_the_wire_spec_is_dropped():
    """The same path drops what the spec does not allow (here: a pFedC client claiming a task
    it sends no branch for)."""
    run_config = app_config(method="pfedc", partitioner="pathological")
    client = make_client(0, run_config)
    initial, wire = initial_state(client.settings)
    strategy = RoundEngine(client.settings, wire, REGISTRY["pfedc"].rule)
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
    valid = strategy.read(RoundPlan(1, {100: None}, {}, None),
                          Exchange([message], [(100, reply)])).updates
    assert valid == []
    assert "missing" in strategy.ledger.record(1).dropped[0]["reason"]
    assert np.count_nonzero(weights) < len(weights)


def _stays_on_the_client(method: str, overrides: dict, client: Client, model, key: str
                         ) -> bool:
    """What each method keeps personal, stated from its paper (and the options that change
    it), not read from its wire spec: a client must never send such a key."""
    module = model.get_submodule(key.rsplit(".", 1)[0]) if "." in key else model
    batchnorm = isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "num_batches_tracked":
        return True
    if overrides.get("dp.mode") and batchnorm and leaf.startswith("running_"):
        return True  # noise would break a variance
    if method == "local":
        return True
    if method in ("fedper", "fedrep"):
        return key.startswith("head.")
    if method == "fedbn":
        return batchnorm
    if method == "feddecomp":
        return leaf in ("lora_A", "lora_B") or (
            overrides.get("feddecomp.bn-stats") == "personal" and leaf.startswith("running_"))
    if method == "factorized-fl":
        variant = overrides.get("factorized-fl.variant", "u")
        if key.startswith("head.") or leaf.startswith("running_"):
            return True
        if variant == "uvm":
            return False
        matching = matching_key(model, client.data().x_train.shape[1:])
        if leaf in ("v", "mu"):
            return key != matching
        return variant == "u-paper" and leaf != "u"
    if method == "ditto":
        return key.startswith("personal.")  # the personal model
    if method == "fedala":
        return leaf.startswith("ala_")  # the aggregation weights and the adapted flag
    if method == "pfedc":
        task = branch_of_key(key)
        weights = client.identity()["pfedc.task-weights"]
        return task is not None and weights[task] == 0
    return False  # fedavg, fedprox, fedavg-ft, fedfac (its rows: below)


@pytest.mark.parametrize(("method", "overrides"), SCENARIOS,
                         ids=[f"{m}-{'-'.join(map(str, o.values())) or 'default'}"
                              for m, o in SCENARIOS])
def test_a_client_sends_exactly_its_methods_shared_part_in_every_round(method, overrides):
    """Every key a client does not keep sends, every key it keeps stays; FedFac's static mode
    sends only the shared rows of its analysed layers once the split exists (its dynamic mode
    sends whole rows: the analysis needs them every round)."""
    for server_round, strategy, clients, valid, _ in _three_rounds(method, overrides):
        settings = clients[0].settings
        initial = initial_state(settings).arrays
        for client, reply in zip(clients, valid, strict=True):
            model = client.model(initial)
            personal = {k for k in model.state_dict()
                        if _stays_on_the_client(method, overrides, client, model, k)}
            assert set(reply.arrays) == set(model.state_dict()) - personal, server_round
            if method == "fedfac":
                split = strategy.rule.split if server_round > 1 else None
                static = settings.method_settings.mode == "static"
                for key, layer in strategy.wire.layer_of_key.items():
                    rows = (int(split[layer].sum()) if static and split is not None
                            else model.state_dict()[key].shape[0])
                    assert reply.arrays[key].shape[0] == rows, (key, server_round)
