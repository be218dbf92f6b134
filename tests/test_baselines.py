"""Baselines' local rules: FedProx's proximal term; FedRep's phase order and freezing;
FedAvg-FT's fine-tuned evaluation."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, RecordDict

from client_app.runtime import Client
from strategies.registry import initial_state, load_settings, wire_spec
from strategies.training import LocalTraining, evaluate_model
from tests.conftest import app_config, make_client, moves_per_epoch


def test_fedprox_adds_mu_times_the_distance_to_the_received_weights_to_each_gradient():
    """FedProx's loss + mu/2 ||w - w_received||^2, on two SGD steps (no momentum) over the
    same two batches: the first step is FedAvg's (w is still the received w_0); the second
    differs from FedAvg's by exactly lr * mu * (w_1 - w_0)."""
    lr, mu = 0.1, 0.5
    config = app_config(**{"local-epochs": 1, "lr": lr, "momentum": 0.0, "model": "mlp",
                           "dataset": "synthetic-fedfac", "fedprox.mu": mu})
    client = make_client(0, {**config, "method": "fedavg"})
    x, y = next(iter(client.loader(True, 1)))
    batches = [(x[:8], y[:8]), (x[8:16], y[8:16])]

    def trained(method: str, steps: int) -> dict[str, torch.Tensor]:
        local = make_client(0, {**config, "method": method})
        model = local.model(initial_state(local.settings).arrays)
        local.method.local_train(LocalTraining(model, batches[:steps], local.settings,
                                               local.device, 1))
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    start = {k: v.detach().clone() for k, v in
             client.model(initial_state(client.settings).arrays).named_parameters()}
    first = trained("fedavg", 1)
    assert all(torch.allclose(trained("fedprox", 1)[k], first[k]) for k in first)
    fedavg, fedprox = trained("fedavg", 2), trained("fedprox", 2)
    for k in start:
        torch.testing.assert_close(fedavg[k] - fedprox[k], lr * mu * (first[k] - start[k]),
                                   rtol=1e-4, atol=1e-6)


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


def test_fedavg_ft_evaluates_a_fine_tuned_copy_and_sends_what_fedavg_sends():
    """FedAvg-FT: the evaluation fine-tunes a copy of the received (here untrained) model for
    local-epochs on the client's train split, which scores far above the received model; the
    received model is left untouched (training starts from it) and the evaluation is the
    same when repeated; what travels is FedAvg's key set."""
    config = app_config(**{"method": "fedavg-ft", "local-epochs": 2})
    client = make_client(0, config)
    received = initial_state(client.settings).arrays
    model = client.model(received)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain = evaluate_model(model, client.loader(train=False), client.device).accuracy
    tuned = client.evaluate(model, 3).accuracy
    assert tuned > plain + 0.3, (plain, tuned)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert client.evaluate(model, 3).accuracy == tuned
    fedavg = wire_spec(load_settings(app_config(method="fedavg")))
    assert wire_spec(client.settings).shared_spec == fedavg.shared_spec


@pytest.mark.parametrize(("method", "overrides", "warned"), [
    ("fedbn", {"dataset": "synthetic-fedfac", "model": "mlp"}, True),  # no BatchNorm
    ("fedbn", {}, False),
    ("pfedc", {"pfedc.tasks": 1}, True),       # one task: pFedC is FedAvg
    ("fedfac", {"fedfac.tau-quantile": -1.0}, True),  # every element shared
    ("fedfac", {}, False),  # every key travels, but the analysed layers' rows stay
    ("fedavg", {}, False),                     # shares everything by design: no warning
    ("fedper", {}, False), ("feddecomp", {}, False), ("factorized-fl", {}, False),
])
def test_a_personalized_method_with_nothing_personal_on_the_model_is_warned_about(
        method, overrides, warned):
    from server_app.app import nothing_personal

    settings = load_settings(app_config(method=method, **overrides))
    warning = nothing_personal(settings, initial_state(settings).wire)
    assert (warning is not None) == warned
    if warned:
        assert warning.startswith(f"{method} keeps nothing personal") and "FedAvg" in warning
