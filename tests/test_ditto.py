"""Ditto: the global model trains as FedAvg's and is all that travels; the personal model is
trained with a proximal term towards the global model as received, starts from the first
global model a client receives, is kept between rounds, and is the model evaluated."""

from __future__ import annotations

import copy

import pytest
import torch

from client_app.runtime import Client
from common.config import ConfigError
from models.ditto import Ditto
from strategies.ditto.client import train_ditto
from strategies.registry import initial_state, load_settings
from strategies.training import LocalTraining, evaluate_model
from tests.conftest import REFERENCE, REFERENCE_CLIENTS, app_config, make_client


def _client(**overrides) -> Client:
    return make_client(0, app_config(**{"method": "ditto", "local-epochs": 2, **overrides}))


@torch.no_grad()
def _distance(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return float(sum(((p - q) ** 2).sum() for p, q in zip(a.parameters(), b.parameters(),
                                                          strict=True)).sqrt())


def test_the_global_model_trains_as_fedavgs_and_only_it_travels():
    """``local-epochs = 2``, ``ditto.personal-epochs = 1``: the global copy after the round
    equals FedAvg's model after one epoch from the same start, seed and batches; the uplink
    is the global copy's entries (FedAvg's, under ``shared.``), never the personal model's."""
    client = _client()
    received = initial_state(client.settings).arrays
    model = client.arrive(received, 0).model
    torch.manual_seed(3)
    train_ditto(LocalTraining(model, client.loader(True, 1), client.settings, client.device, 1))
    fedavg = make_client(0, app_config(**{"method": "fedavg", "local-epochs": 1}))
    plain = fedavg.model(initial_state(fedavg.settings).arrays)
    torch.manual_seed(3)
    fedavg.method.local_train(LocalTraining(plain, fedavg.loader(True, 1), fedavg.settings,
                                            fedavg.device, 1))
    shared = client.shared_arrays(model, received).to_torch_state_dict()
    expected = fedavg.shared_arrays(plain, initial_state(fedavg.settings).arrays)
    assert set(shared) == {f"shared.{k}" for k in expected}
    for key, value in expected.to_torch_state_dict().items():
        assert torch.equal(shared[f"shared.{key}"], value), key
    assert not torch.equal(model.personal.head.weight, model.shared.head.weight)


def test_a_large_lambda_pulls_the_personal_model_to_the_received_global_model():
    """The personal model starts away from the received global model; with
    ``ditto.lambda = 0`` its training leaves it far, with a large one it ends much nearer
    (the proximal term's pull towards ``w_t``, not towards the global copy being trained)."""
    def personal_distance(lam: float) -> tuple[float, float]:
        client = _client(**{"ditto.lambda": lam, "lr": 0.02, "momentum": 0.0})
        model: Ditto = client.model(initial_state(client.settings).arrays)
        received = copy.deepcopy(model.shared)  # w_t, to measure against
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.personal.parameters():
                p.add_(0.05 * torch.randn_like(p))
        before = _distance(model.personal, received)
        torch.manual_seed(3)
        train_ditto(LocalTraining(model, client.loader(True, 1), client.settings,
                                  client.device, 1))
        return before, _distance(model.personal, received)

    before, free = personal_distance(0.0)
    _, pulled = personal_distance(20.0)
    assert pulled < before / 2
    assert pulled < free / 2


def test_the_personal_model_starts_from_the_first_global_model_then_is_kept_and_evaluated():
    """A client without a personal model starts it from the global model it receives; once
    it has one (kept in ``context.state`` after training), it keeps it whatever arrives, and
    its evaluation scores the personal model."""
    client = _client()
    received = initial_state(client.settings).arrays
    trained = client.arrive(received, 0).model
    torch.manual_seed(1)
    train_ditto(LocalTraining(trained, client.loader(True, 1), client.settings,
                              client.device, 1))
    other = client.shared_arrays(trained, received)  # a global model unlike the initial one
    fresh: Ditto = _client().arrive(other, 1).model
    assert all(torch.equal(a, b) for a, b in zip(fresh.personal.state_dict().values(),
                                                 fresh.shared.state_dict().values(),
                                                 strict=True))
    client.keep_personal(trained, received, other, 1)
    kept: Ditto = Client.from_context(client.context).arrive(other, 1).model
    for key, value in trained.personal.state_dict().items():
        assert torch.equal(kept.personal.state_dict()[key], value), key
    scored = client.evaluate(kept, 1)
    assert scored == evaluate_model(kept.personal, client.loader(train=False), client.device)


def test_ditto_needs_an_epoch_for_each_model():
    with pytest.raises(ConfigError, match=r"ditto\.personal-epochs: 2 leaves no epoch"):
        load_settings(app_config(**{"method": "ditto", "local-epochs": 2,
                                    "ditto.personal-epochs": 2}))
    with pytest.raises(ConfigError, match=r"ditto\.personal-epochs: 0 is out of range"):
        load_settings(app_config(**{"method": "ditto", "ditto.personal-epochs": 0}))


@pytest.mark.integration
def test_ditto_runs_and_sends_fedavgs_tensors(shared_runs):
    """A real run (the reference: 3 rounds, 3 clients, the user's model, personal state
    carried between rounds): every client trains and is evaluated each round, and the uplink
    is FedAvg's tensors (bytes: FedAvg's plus the ``shared.`` prefix of each key name)."""
    runs = {m: shared_runs.reference(m)[1] for m in ("fedavg", "ditto")}
    keys = len(initial_state(load_settings(app_config(method="fedavg",
                                                      model=REFERENCE["model"]))).arrays)
    for entry, plain in zip(runs["ditto"]["rounds"], runs["fedavg"]["rounds"], strict=True):
        assert "dropped" not in entry
        assert entry["train"]["num_clients"] == REFERENCE_CLIENTS
        assert entry["bytes_up"] == plain["bytes_up"] + REFERENCE_CLIENTS * keys * len("shared.")
