"""Baselines' local rules: FedRep's phase order and freezing."""

from __future__ import annotations

import torch
from flwr.app import Context, RecordDict

from client_app.runtime import Client
from server_app.app import initial_shared_arrays
from strategies.training import LocalTraining
from tests.conftest import EpochSnapshots, app_config, moved


def test_fedrep_trains_the_head_first_then_the_body_with_the_other_frozen():
    """local-epochs 2, fedrep.head-epochs 1: epoch 1 moves every head parameter and nothing
    else; epoch 2 moves every body parameter and not the head."""
    client = Client.from_context(Context(
        run_id=1, node_id=0, node_config={"partition-id": 0, "num-partitions": 4},
        state=RecordDict(), run_config=app_config(**{
            "method": "fedrep", "local-epochs": 2, "fedrep.head-epochs": 1})))
    model = client.model(initial_shared_arrays(client.settings))
    loader = EpochSnapshots(client.loader(True, 1), model)
    torch.manual_seed(1)
    client.method.local_train(LocalTraining(model, loader, client.settings, client.device, 1))
    start, between = loader.snapshots
    end = dict(model.named_parameters())
    head = {k for k in start if k.startswith("head.")}
    body = {k for k in start if k.startswith("body.")}
    assert head and body and head | body == set(start)
    assert moved(start, between) == head
    assert moved(between, end) == body
