"""FedALA: adaptive local aggregation where a model arrives (the client hook ``Method.adapt``):
the weights stay in [0, 1], the lower layers are the global model's, the first adaptation
trains to convergence and later ones one epoch, and a train message's fused evaluation scores
the adapted model, as an evaluate message does."""

from __future__ import annotations

import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

import strategies.fedala.client as fedala_client
from client_app.app import evaluate_personalized, train
from client_app.runtime import Client
from common.config import ConfigError
from common.protocol import (
    ARRAYS,
    CONFIG,
    EVAL_ACCURACY,
    EVAL_LOSS,
    EVALUATE_FIRST,
    METRICS,
    SERVER_ROUND,
)
from models.fedala import ADAPTED, adapted_names, weight_key
from strategies.registry import initial_state, load_settings
from strategies.training import LocalTraining, train_everything
from tests.conftest import REFERENCE_CLIENTS, app_config

pytestmark = pytest.mark.usefixtures("server_task")


def _context(**overrides) -> Context:
    return Context(run_id=1, node_id=100, state=RecordDict(),
                   node_config={"partition-id": 0, "num-partitions": 4},
                   run_config=app_config(**{"method": "fedala", "local-epochs": 1,
                                            **overrides}))


def _with_a_local_model(context: Context) -> tuple[Client, ArrayRecord]:
    """The client after one round of local training from the initial model (its personal
    state: the trained model, ``W`` at ones, not yet adapted), and the global model it then
    receives: the initial one, untrained, far from its local model."""
    client = Client.from_context(context)
    received = initial_state(client.settings).arrays
    model = client.arrive(received, 0).model  # no local model yet: nothing to adapt
    torch.manual_seed(1)
    train_everything(LocalTraining(model, client.loader(True, 1), client.settings,
                                   client.device, 1))
    client.keep_personal(model, received, client.shared_arrays(model, received), 1)
    return client, received


def test_the_higher_layers_are_mixed_with_weights_in_0_1_the_lower_ones_are_the_global_models():
    client, received = _with_a_local_model(_context(**{"fedala.layers": 3}))
    own, arrived = client.personal_state(), received.to_torch_state_dict()
    model = client.arrive(received, 1).model
    names = adapted_names(model)
    assert len(names) == 3 and "head.weight" in names and "head.bias" in names
    state, weights = model.state_dict(), {}
    for name in names:
        w = state[weight_key(name)]
        assert float(w.min()) >= 0.0 and float(w.max()) <= 1.0, name
        assert not torch.equal(w, torch.ones_like(w)), name  # learned
        weights[name] = w
        expected = own[name] + (arrived[name] - own[name]) * w
        torch.testing.assert_close(state[name], expected)
    assert any(float(w.min()) < 1.0 for w in weights.values())
    for key, value in arrived.items():  # every other tensor as it arrived
        if key not in names:
            assert torch.equal(state[key], value), key
    assert float(state[ADAPTED]) == 1.0
    # a client without a local model keeps the global model as it arrived
    fresh = Client.from_context(_context(**{"fedala.layers": 3})).arrive(received, 1).model
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in arrived.items())


def test_the_first_adaptation_trains_to_convergence_then_one_epoch(monkeypatch):
    """``fedala.threshold = 0``: the first adaptation runs ``fedala.max-epochs``; once the
    client has adapted (its flag kept with its personal state), one epoch."""
    epochs = []

    def counted(job, fraction):
        loader = sampled(job, fraction)
        assert len(loader.dataset) == math.ceil(0.5 * len(job.loader.dataset))
        epochs.append(0)

        class Counting:
            def __iter__(self):
                epochs[-1] += 1
                return iter(loader)

        return Counting()

    sampled = fedala_client.sampled
    monkeypatch.setattr(fedala_client, "sampled", counted)
    client, received = _with_a_local_model(_context(**{
        "fedala.threshold": 0.0, "fedala.max-epochs": 4, "fedala.data-fraction": 0.5}))
    model = client.arrive(received, 1).model
    assert epochs == [4]
    client.keep_personal(model, received, client.shared_arrays(model, received), 2)
    client.arrive(received, 2)
    assert epochs == [4, 1]


def test_a_train_messages_fused_evaluation_scores_the_adapted_model():
    """Round 2's train message carries round 1's evaluation: it scores the model after the
    adaptation on the client's data, not the merged one, exactly as round 1's evaluate
    message does (both protocols adapt alike: seeded by the round the arrays are of)."""
    context = _context()
    client, received = _with_a_local_model(context)
    config = ConfigRecord({SERVER_ROUND: 1})
    adapted = client.evaluate(client.arrive(received, 1, config).model, 1)
    merged = client.evaluate(client.model(received, 1, config), 1)
    assert adapted.loss != merged.loss  # the adaptation changes what is scored
    separate = evaluate_personalized(Message(RecordDict({ARRAYS: received, CONFIG: config}),
                                             dst_node_id=100,
                                             message_type=MessageType.EVALUATE), context)
    fused = train(Message(RecordDict({ARRAYS: received, CONFIG: ConfigRecord(
        {SERVER_ROUND: 2, EVALUATE_FIRST: True})}), dst_node_id=100,
        message_type=MessageType.TRAIN), context)
    assert not fused.has_error(), fused.error
    metrics = fused.content[METRICS]
    assert metrics[EVAL_LOSS] == adapted.loss == separate.content[METRICS]["loss"]
    assert metrics[EVAL_ACCURACY] == adapted.accuracy == separate.content[METRICS]["accuracy"]
    # training started from the adapted model: the client adapted (its flag is kept)
    assert float(client.personal_state()[ADAPTED]) == 1.0


def test_under_dp_the_update_is_measured_from_the_model_as_it_arrived():
    """The adaptation reads the client's data: under ``dp.mode`` the start its update is
    measured from is the model before it (the global model here), so what the adaptation
    moves is inside the clipped update."""
    client, received = _with_a_local_model(_context(**{"dp.mode": "central"}))
    model, start = client.arrive(received, 1, identity=client.identity())
    arrived = received.to_torch_state_dict()
    assert start is not None and set(start) == set(arrived)
    for key, value in start.to_torch_state_dict().items():
        assert torch.equal(value, arrived[key]), key
    assert not torch.equal(model.state_dict()["head.weight"], arrived["head.weight"])


def test_fedala_layers_beyond_the_models_tensors_stop_the_run_at_start():
    with pytest.raises(ConfigError, match=r"fedala\.layers: 99 is more than the model's"):
        load_settings(app_config(**{"method": "fedala", "fedala.layers": 99}))


@pytest.mark.integration
def test_fedala_runs_and_sends_fedavgs_bytes(shared_runs):
    """A real run (the reference: 3 rounds, 3 clients, the user's model): the whole model
    travels both ways, FedAvg's bytes; the weights and the flag never leave a client."""
    bytes_up = {}
    for method in ("fedavg", "fedala"):
        _, results = shared_runs.reference(method)
        assert all("dropped" not in r for r in results["rounds"])
        assert all(r["train"]["num_clients"] == REFERENCE_CLIENTS for r in results["rounds"])
        bytes_up[method] = [r["bytes_up"] for r in results["rounds"]]
    assert bytes_up["fedala"] == bytes_up["fedavg"]
