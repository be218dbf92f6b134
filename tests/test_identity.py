"""Who speaks for a client id (docs/security.md, ``strategies/engine/identity.py``): an id
belongs to one node at a time, a node to one id; a live, responsive holder is never evicted,
a dead or silent one is; ids are capped and expire; and which nodes get work, in what order."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from common.protocol import CLIENT, CONFIG
from strategies.engine.exchange import Exchange
from strategies.engine.identity import NodeDirectory, wait_for_nodes
from tests.test_trust import _engine

pytestmark = pytest.mark.usefixtures("server_task")


def _claims(engine, nodes: dict[int, str], names: dict[int, str] | None = None,
            server_round: int = 1) -> list[str]:
    """Identify replies of ``nodes`` (node -> claimed id), through the validation path; the
    client ids accepted."""
    engine.nodes.observe([SimpleNamespace(node_id=n, name=(names or {}).get(n, ""))
                          for n in {*(engine.nodes.live or ()), *nodes}])
    sent, replies = [], []
    for node, client_id in nodes.items():
        message = Message(RecordDict({CONFIG: ConfigRecord({"action": "identify"})}),
                          dst_node_id=node, message_type=MessageType.QUERY)
        reply = Message(RecordDict({CLIENT: ConfigRecord({
            "client-id": client_id, "partition-id": 0, "num-partitions": 1})}),
            reply_to=message)
        sent.append(message)
        replies.append((node, reply))
    return [r.client_id for r in engine.replies.valid(
        server_round, "identify", Exchange(sent, replies), None)]


def test_a_registered_node_speaks_only_for_its_name_or_its_mapped_ids():
    engine, _ = _engine(**{"identity.node-owners": "gateway=site-7, gateway=site-8"})
    names = {1: "site-0", 2: "site-1", 3: "gateway"}
    assert _claims(engine, {1: "site-0", 2: "site-0", 3: "site-7"}, names) == ["site-0",
                                                                               "site-7"]
    reason = engine.ledger.record(1).dropped[0]["reason"]
    assert "registered as site-1 may not speak for client id site-0" in reason
    assert _claims(engine, {3: "site-0"}, names) == []  # not among gateway's ids
    assert engine.nodes.node_to_client == {1: "site-0", 3: "site-7"}


def test_require_registered_refuses_nodes_without_a_name():
    engine, _ = _engine(**{"identity.require-registered": True})
    assert _claims(engine, {1: "site-0"}) == []
    assert "no registered name" in engine.ledger.record(1).dropped[0]["reason"]


def test_without_authentication_a_live_holder_is_not_evicted_but_a_dead_one_is():
    engine, _ = _engine()
    assert _claims(engine, {1: "0"}) == ["0"]
    assert _claims(engine, {2: "0"}) == []  # node 1 is live and answered: refused
    assert "held by live node 1" in engine.ledger.record(1).dropped[0]["reason"]
    assert engine.nodes.samplable([1, 2]) == [1]  # the refused node gets no work
    engine.nodes.missed([1])  # node 1 missed a message (a SuperNode that died) ...
    assert _claims(engine, {2: "0"}, server_round=2) == ["0"]  # ... its client rejoins
    assert engine.nodes.samplable([1, 2]) == [2]
    engine.nodes.observe([SimpleNamespace(node_id=2, name="")])  # node 1 is gone
    assert _claims(engine, {3: "0"}, server_round=3) == []  # node 2 is live


def test_simultaneous_claims_of_a_free_id_are_all_refused():
    engine, _ = _engine()
    assert _claims(engine, {1: "0", 2: "0", 3: "1"}) == ["1"]
    reasons = [d["reason"] for d in engine.ledger.record(1).dropped]
    assert len(reasons) == 2 and all("several nodes" in r for r in reasons)


def test_client_ids_are_capped_and_expire_with_their_tables():
    engine, _ = _engine("pfedc", **{"identity.max-clients": 2,
                                    "identity.expire-rounds": 3})
    assert _claims(engine, {1: "a", 2: "b", 3: "c"}) == ["a", "b"]
    assert "max-clients=2" in engine.ledger.record(1).dropped[0]["reason"]
    engine.evaluation.per_client_accuracy.update({"a": 0.5, "b": 0.6})
    engine.rule.task_weights.update({"a": [1.0], "b": [1.0]})
    assert _claims(engine, {2: "b"}, server_round=4) == ["b"]
    engine.forget_expired(5)  # "a" last heard from in round 1
    assert set(engine.evaluation.per_client_accuracy) == set(engine.rule.task_weights) == {"b"}
    assert engine.nodes.client_of(1) is None
    assert _claims(engine, {3: "c"}, server_round=5) == ["c"]  # room again


def test_a_node_keeps_the_id_it_first_spoke_for():
    """Node 1 speaks for "a", then claims "b": refused, and it still works as "a"; a later
    reply of an earlier round does not move its last-heard round back."""
    engine, _ = _engine(**{"identity.expire-rounds": 3})
    assert _claims(engine, {1: "a"}, server_round=5) == ["a"]
    assert _claims(engine, {1: "b"}, server_round=5) == []
    assert "node speaks for client id a, not b" in engine.ledger.record(5).dropped[0]["reason"]
    assert engine.nodes.node_to_client == {1: "a"} and engine.nodes.samplable([1]) == [1]
    assert _claims(engine, {1: "a"}, server_round=3) == ["a"]
    engine.forget_expired(8)  # heard from in round 5: kept
    assert engine.nodes.client_of(1) == "a"


def test_the_holder_keeps_its_id_when_another_node_claims_it_in_the_same_batch():
    engine, _ = _engine()
    assert _claims(engine, {1: "0"}) == ["0"]
    engine.nodes.missed([1])  # either claim alone would pass: the holder's reply wins
    assert _claims(engine, {1: "0", 2: "0"}, server_round=2) == ["0"]
    assert engine.nodes.node_to_client == {1: "0"}


def test_a_holder_that_answers_again_keeps_its_id_and_a_silent_one_loses_it():
    """``missed`` then ``answered``: responsive again, its id is refused to another node. A
    holder that did not answer an identify query (silent) is not responsive: its client may
    come back on a new node; the silent node, answering later, is sampled again."""
    engine, _ = _engine()
    nodes = engine.nodes
    assert _claims(engine, {1: "0", 2: "1"}) == ["0", "1"]
    nodes.missed([1])
    nodes.answered([1])
    assert _claims(engine, {3: "0"}) == []
    nodes.heard_from([1, 2], [2])  # node 1 silent
    assert nodes.samplable([1, 2]) == [2]
    assert _claims(engine, {3: "0"}, server_round=2) == ["0"]
    nodes.heard_from([2, 4], [2, 4])
    nodes.heard_from([1], [1])  # a silent node that answers is no longer silent
    assert 1 not in nodes.silent_nodes


def test_a_replaced_node_holds_nothing():
    """Node 1's client came back on node 2: node 1 is not asked who it is, gets no work, is
    not among the client's nodes, and does not hold the id against a third node once node
    2 is gone, even if node 1 answers again."""
    engine, _ = _engine()
    nodes = engine.nodes
    assert _claims(engine, {1: "0"}) == ["0"]
    nodes.missed([1])
    assert _claims(engine, {2: "0"}, server_round=2) == ["0"]
    assert nodes.unidentified([1, 2, 5], 3) == [5] and nodes.samplable([1, 2]) == [2]
    assert nodes.nodes_of({"0"}) == [2]
    nodes.answered([1])
    nodes.missed([2])
    assert _claims(engine, {3: "0"}, server_round=3) == ["0"]


def test_a_node_is_asked_who_it_is_once_a_round():
    nodes = NodeDirectory()
    assert nodes.unidentified([7, 8], 1) == [7, 8]
    assert nodes.unidentified([7, 8, 9], 1) == [9]
    assert nodes.unidentified([7, 8], 2) == [7, 8]


def test_work_goes_to_clients_in_client_order_never_to_excluded_ones():
    """Sampling must not depend on node ids (random, new each run): numeric client ids in
    numeric order, then names, then nodes not identified yet; excluded clients get none."""
    engine, _ = _engine()
    nodes = engine.nodes
    assert _claims(engine, {50: "10", 40: "9", 30: "site", 20: "2"}) == ["2", "9", "10",
                                                                         "site"]
    assert nodes.samplable([60, 50, 40, 30, 20]) == [20, 40, 50, 30, 60]
    nodes.excluded_clients.add("9")
    assert nodes.samplable([60, 50, 40, 30, 20]) == [20, 50, 30, 60]


def test_an_id_expires_after_expire_rounds_without_a_word_and_not_before():
    engine, _ = _engine(**{"identity.expire-rounds": 3})
    assert _claims(engine, {1: "a"}) == ["a"]
    engine.nodes.identified(1, "a", {"partition-id": 0})
    engine.forget_expired(4)  # heard from 3 rounds ago: kept
    assert engine.nodes.client_of(1) == "a" and "a" in engine.nodes.client_info
    engine.forget_expired(5)
    assert engine.nodes.client_of(1) is None and "a" not in engine.nodes.client_info


class _Grid:
    """What ``wait_for_nodes`` asks of a Grid: the connected nodes."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_nodes(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(node_id=n, name="") for n in range(self.count)]


def test_the_run_starts_as_soon_as_min_nodes_are_connected(caplog):
    caplog.set_level(logging.INFO, logger="flwr")
    assert wait_for_nodes(_Grid(3), NodeDirectory(), 3, 30.0) == [0, 1, 2]
    assert "waiting for nodes" not in caplog.text
