"""Baselines' local rules: FedRep's phase order and freezing."""

from __future__ import annotations

from flwr.app import Context, RecordDict

from client_app.runtime import Client
from tests.conftest import app_config, moves_per_epoch


def test_fedrep_trains_the_head_first_then_the_body_with_the_other_frozen():
    """local-epochs 2, fedrep.head-epochs 1: epoch 1 moves every head parameter and nothing
    else; epoch 2 moves every body parameter and not the head."""
    client = Client.from_context(Context(
        run_id=1, node_id=0, node_config={"partition-id": 0, "num-partitions": 4},
        state=RecordDict(), run_config=app_config(**{
            "method": "fedrep", "local-epochs": 2, "fedrep.head-epochs": 1})))
    (first, second), names = moves_per_epoch(client)
    head = {k for k in names if k.startswith("head.")}
    body = {k for k in names if k.startswith("body.")}
    assert head and body and head | body == names
    assert first == head
    assert second == body
