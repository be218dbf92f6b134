"""FedFac on its clients: layer selection and element keys, personal rows kept and shared rows
received, FedAvg equivalence, new clients (LocalTrain, Ensemble), real rounds on the wire."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn

from client_app.runtime import Client
from common.config import ConfigError
from common.protocol import ARRAYS, METRICS, TASK_ACCURACY, ClientReply
from models import build_backbone
from models.fedfac import analysed_layers, element_keys, forward_layers, weighted_layers
from strategies.engine import MethodRule
from strategies.fedfac import client as fedfac_client
from strategies.fedfac.spec import MASK_PREFIX, MEMBER_PREFIX
from strategies.registry import build_model, initial_state, load_settings, wire_spec
from strategies.training import LocalTraining, accuracy_scores, evaluate_model
from tests.conftest import app_config, read_results
from tests.test_fedfac import fedfac_rule

ROOT = Path(__file__).resolve().parents[1]


DIGITS = (1, 8, 8)


def test_layer_selection_and_element_keys():
    model = build_model(load_settings(app_config(method="fedfac")))
    assert analysed_layers(model, "0", DIGITS) == ["body.0"]
    assert analysed_layers(model, "body.4, -2", DIGITS) == ["body.4", "body.9"]
    assert analysed_layers(model, "-4, 1, 2", DIGITS) == ["body.0", "body.4", "body.9"]
    assert element_keys(model, "body.0") == ["body.0.weight", "body.1.weight", "body.1.bias",
                                             "body.1.running_mean", "body.1.running_var"]
    assert element_keys(model, "body.9") == ["body.9.weight", "body.9.bias"]
    assert analysed_layers(model, "0, body.0, -4", DIGITS) == ["body.0"]  # each layer once
    for out_of_range in ("9", "4", "-5"):  # four layers in forward order: [-4, 3]
        with pytest.raises(ConfigError, match=r"fedfac\.layers: index .* is out of range"):
            load_settings(app_config(**{"method": "fedfac", "fedfac.layers": out_of_range}))


class _NormsAroundALinear(nn.Module):
    """A user's model with BatchNorms registered after a layer that are not its own:
    ``norm_twice`` (a second norm of ``fc``'s width, after ``fc``'s own ``norm``) and
    ``norm_in`` (8 features, registered right after ``wide``, whose outputs are 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16)
        self.norm_twice = nn.BatchNorm1d(16)
        self.wide = nn.Linear(8, 4)
        self.norm_in = nn.BatchNorm1d(8)


def test_an_element_owns_only_the_batchnorm_of_its_own_width_that_directly_follows():
    """An element owns entry ``j`` of the first BatchNorm registered after its layer (before
    any other Linear/Conv2d), and only when that norm has the layer's width: not a second
    norm after it, not a norm of another width."""
    model = _NormsAroundALinear()
    assert element_keys(model, "fc") == ["fc.weight", "fc.bias", "norm.weight", "norm.bias",
                                         "norm.running_mean", "norm.running_var"]
    assert element_keys(model, "wide") == ["wide.weight", "wide.bias"]  # norm_in: 8 wide


def test_defaults_are_the_papers_deepest_hidden_layer_and_90_percent_quantile():
    """Pinned to the paper: ``fedfac.layers = "-2"``, the hidden layer that feeds the
    classifier (the paper splits the deepest hidden layers, section 5.3; the authors' scripts
    analyse ResNet-18's last conv, ``--partial_cnn_layer 20``, VGG16's last hidden Linear,
    ``15``, and the Shakespeare model's hidden Linear, ``4``, never the classifier).
    ``fedfac.tau-quantile = 0.9``: the paper's optimum under strong heterogeneity is the
    90-95% quantile (Table 5, as the review reports it); the authors' FEMNIST script passes
    ``--threshold_p --threshold 90``, and their strongest-skew CIFAR scripts make the whole
    layer personal."""
    settings = load_settings(app_config(method="fedfac"))
    assert settings.method_settings.layers == "-2"
    assert settings.method_settings.tau_quantile == 0.9
    assert wire_spec(settings).layers == ["body.9"]  # digits CNN: the 128-unit hidden Linear


@pytest.mark.parametrize(("model", "shape", "penultimate"), [
    ("mlp", (64,), "body.1"),
    ("cnn", DIGITS, "body.9"),
    ("lenet5", (1, 28, 28), "body.11"),
    ("resnet8", (3, 32, 32), "body.5.conv2"),     # not the last block's shortcut (side branch)
    ("resnet9", (3, 32, 32), "body.16.block.3"),
    ("resnet18", (3, 32, 32), "body.10.conv2"),
    ("user_models:classifier_first", DIGITS, "body.hidden"),  # registered before its input
    ("user_models:resnet18", DIGITS, "body.layer4.1.conv2"),
])
def test_minus_two_is_the_layer_before_the_classifier_on_every_backbone(model, shape,
                                                                       penultimate):
    """Indices count layers in forward order, whatever the registration order; a layer that
    reads the tensor an earlier layer read (a projection shortcut) has no index but a name;
    the classifier is ``-1`` and is refused."""
    torch.manual_seed(0)
    backbone = build_backbone(model, shape, 10)
    order = forward_layers(backbone, shape)
    assert order[-1] == "head" and order[-2] == penultimate
    assert analysed_layers(backbone, "-2", shape) == [penultimate]
    assert analysed_layers(backbone, "0", shape) == [order[0]]
    assert isinstance(backbone.get_submodule(penultimate), nn.Linear | nn.Conv2d)
    for classifier in ("-1", "head", str(len(order) - 1)):
        with pytest.raises(ConfigError, match=r"fedfac\.layers: .* is the classifier 'head'"):
            analysed_layers(backbone, classifier, shape)
    shortcuts = [n for n in weighted_layers(backbone) if "shortcut" in n or "downsample" in n]
    assert not set(shortcuts) & set(order)
    if shortcuts:  # chosen by name
        assert analysed_layers(backbone, shortcuts[-1], shape) == [shortcuts[-1]]


def test_the_classifier_is_refused_at_start_with_one_line():
    with pytest.raises(ConfigError, match=r"^fedfac\.layers: '-1' is the classifier") as error:
        load_settings(app_config(**{"method": "fedfac", "fedfac.layers": "-1"}))
    assert "\n" not in str(error.value)


def _client(pid: int, **overrides) -> Client:
    return Client.from_context(Context(
        run_id=1, node_id=pid, node_config={"partition-id": pid, "num-partitions": 4},
        state=RecordDict(), run_config=app_config(**{
            "method": "fedfac", "fedfac.layers": "0", **overrides})))  # the tests: body.0


def _reply(client: Client, received: ArrayRecord) -> ClientReply:
    model = client.model(received)
    torch.manual_seed(client.partition_id)
    client.method.local_train(LocalTraining(model, client.loader(True, 1), client.settings,
                                            client.device, 1))
    return ClientReply(client.partition_id, client.client_id,
                       client.shared_arrays(model, received),
                       MetricRecord({"num-examples": len(client.data().y_train)}),
                       ConfigRecord({"client-id": client.client_id}))


def test_all_shared_layer_equals_fedavg():
    overrides = {"fedfac.layers": "0,1", "fedfac.tau-quantile": -1.0}
    clients = [_client(pid, **overrides) for pid in range(3)]
    settings = clients[0].settings
    initial = initial_state(settings).arrays
    replies = [_reply(c, initial) for c in clients]
    wire = wire_spec(settings)
    fedfac = fedfac_rule(settings, wire).merge_updates(1, replies, initial)
    fedavg = fedfac_rule(settings, wire, MethodRule).merge_updates(1, replies, initial)
    assert set(fedfac) == set(fedavg)
    for key in fedavg:
        np.testing.assert_allclose(fedfac[key].numpy(), fedavg[key].numpy(), rtol=1e-5,
                                   atol=1e-6)


def test_personal_rows_stay_on_the_client_and_shared_rows_come_from_the_server():
    client = _client(0)
    initial = initial_state(client.settings).arrays
    strategy = fedfac_rule(client.settings, client.wire)
    model = client.model(initial)
    with torch.no_grad():
        model.body[0].weight.add_(1.0)  # this client's own conv kernels
    client.keep_personal(model, initial, client.shared_arrays(model, initial))
    own = model.body[0].weight.detach().clone()
    strategy.split = {"body.0": np.arange(32) % 4 == 0}   # 8 shared channels
    down = strategy.downlink(2, "0", initial)
    assert down["body.0.weight"].shape[0] == 8 and f"{MASK_PREFIX}body.0" in down
    merged = client.model(down).body[0].weight.detach()
    mask = torch.from_numpy(strategy.split["body.0"])
    torch.testing.assert_close(merged[~mask], own[~mask])
    torch.testing.assert_close(merged[mask], torch.from_numpy(initial["body.0.weight"].numpy())[
        mask])
    sent = client.shared_arrays(client.model(down), down)
    assert sent["body.0.weight"].shape[0] == 8  # static: personal rows are not sent
    # rows that do not match the mask that came with them are refused, not broadcast
    for rows in (1, 9):
        wrong = ArrayRecord({**dict(down.items()), "body.0.weight": Array(
            np.zeros((rows, *own.shape[1:]), np.float32))})
        with pytest.raises(ValueError, match=r"'body\.0\.weight' does not fit the shared rows"):
            client.model(wrong)


def test_whole_layer_personal_sends_no_rows():
    client = _client(0, **{"fedfac.tau-quantile": 2.0})
    initial = initial_state(client.settings).arrays
    strategy = fedfac_rule(client.settings, client.wire)
    strategy.merge_updates(1, [_reply(client, initial), _reply(_client(1), initial)],
                              initial)
    assert not strategy.split["body.0"].any()
    down = strategy.downlink(2, "0", initial)
    assert down["body.0.weight"].shape[0] == 0


def test_new_client_localtrain_trains_only_its_personal_rows(monkeypatch):
    """LocalTrain: the new client takes the shared part and trains only the personal rows of
    the analysed layers; shared rows and every other parameter stay as received, and the
    accuracy it reports is that model's."""
    client = _client(3, **{"local-epochs": 1})
    initial = initial_state(client.settings).arrays
    strategy = fedfac_rule(client.settings, client.wire)
    strategy.split = {"body.0": np.arange(32) % 4 == 0}
    down = strategy.downlink(0, None, initial)
    scored = []

    def spy(model, loader, device):
        scored.append(model)
        return evaluate_model(model, loader, device)

    monkeypatch.setattr(fedfac_client, "evaluate_model", spy)
    reply = fedfac_client.local_train_personal_rows(
        client, SimpleNamespace(content=RecordDict({ARRAYS: down})))
    (model,) = scored
    start = dict(_fresh(client).named_parameters())
    shared = torch.from_numpy(strategy.split["body.0"])
    element_keys_of = set(client.wire.layer_of_key)
    for name, value in model.named_parameters():
        value = value.detach().cpu()
        if name in element_keys_of:
            torch.testing.assert_close(value[shared], start[name].detach()[shared])
            assert not torch.equal(value[~shared], start[name].detach()[~shared]), name
        else:
            torch.testing.assert_close(value, start[name].detach(), rtol=0, atol=0)
    scores = evaluate_model(model, client.loader(False), client.device)
    assert reply[METRICS]["accuracy"] == scores.accuracy
    assert reply[METRICS][TASK_ACCURACY] == scores.task_accuracy


def test_an_existing_client_sends_its_personal_rows_only_when_not_under_dp():
    """``fedfac.personal`` (the Ensemble's query): an existing client answers with exactly its
    analysed layers' element tensors as it holds them after its own training, not the seeded
    start; under ``dp.mode`` it refuses on its own, whatever the server asks (start-up refuses
    ``fedfac.new-clients`` with DP too, but a client under DP trusts no server to have
    checked)."""
    client = _client(0)
    initial = initial_state(client.settings).arrays
    model = client.model(initial)
    with torch.no_grad():  # this client's own kernels and BatchNorm statistics
        model.body[0].weight.add_(1.0)
        model.body[1].running_mean.add_(2.0)
    client.keep_personal(model, initial, client.shared_arrays(model, initial))
    held = {k: v.detach().clone() for k, v in model.state_dict().items()}
    reply = fedfac_client.personal_elements(client, SimpleNamespace(content=RecordDict()))
    sent = reply[ARRAYS].to_torch_state_dict()
    assert sorted(sent) == ["body.0.weight", "body.1.bias", "body.1.running_mean",
                            "body.1.running_var", "body.1.weight"]  # fedfac.layers = "0"
    for key, value in sent.items():
        torch.testing.assert_close(value, held[key].cpu(), rtol=0, atol=0)
    start = _fresh(client).state_dict()
    assert not torch.equal(sent["body.0.weight"], start["body.0.weight"])
    private = _client(0, **{"dp.mode": "local", "dp.noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match=r"under dp\.mode this client sends no personal rows"):
        fedfac_client.personal_elements(private, SimpleNamespace(content=RecordDict()))


def _fresh(client: Client) -> torch.nn.Module:
    """The model a new client starts from (the seeded initialisation; its shared rows equal
    the server's initial arrays)."""
    return client.method.build_model(client.settings)


def _accuracy(predict, client: Client) -> float:
    correct = count = 0
    with torch.no_grad():
        for x, y in client.loader(False):
            correct += int((predict(x).argmax(1) == y).sum())
            count += len(y)
    return correct / count


def test_new_client_ensemble_averages_the_members_softmax():
    """Ensemble: the new client's accuracy is that of the mean softmax of the members'
    personalized models; the mean of their logits, one member alone and the shared model
    alone each score differently on this client, so none of them passes for it."""
    client = _client(3)
    trainer = _client(0, **{"local-epochs": 2})
    trained = trainer.model(initial_state(trainer.settings).arrays)
    torch.manual_seed(0)
    trainer.method.local_train(LocalTraining(trained, trainer.loader(True, 1), trainer.settings,
                                             trainer.device, 1))
    shared = trained.state_dict()
    base = ArrayRecord({k: Array(shared[k].numpy()) for k in client.wire.shared_keys})
    generator = torch.Generator().manual_seed(0)
    members, models = {}, []
    for i in range(3):
        state = dict(shared)
        for key in client.wire.always_personal:
            if key.endswith(("weight", "bias")):
                state[key] = state[key] + torch.randn(state[key].shape, generator=generator)
            members[f"{MEMBER_PREFIX}{i}.{key}"] = Array(state[key].numpy())
        model = _fresh(client)
        model.load_state_dict(state)
        models.append(model.eval())
    reply = fedfac_client.ensemble_accuracy(client, SimpleNamespace(
        content=RecordDict({ARRAYS: ArrayRecord({**dict(base.items()), **members})})))
    softmax = _accuracy(lambda x: torch.stack([m(x).softmax(1) for m in models]).mean(0),
                        client)
    assert reply[METRICS]["accuracy"] == pytest.approx(softmax)
    with torch.no_grad():  # its task accuracy is of the same ensemble predictions
        scored = [(torch.stack([m(x).softmax(1) for m in models]).mean(0).argmax(1), y)
                  for x, y in client.loader(False)]
    assert reply[METRICS][TASK_ACCURACY] == pytest.approx(accuracy_scores(
        torch.cat([p for p, _ in scored]), torch.cat([y for _, y in scored]))[1])
    alone = _fresh(client)
    alone.load_state_dict(shared)
    alternatives = [_accuracy(lambda x: torch.stack([m(x) for m in models]).mean(0), client),
                    _accuracy(models[0], client), _accuracy(alone.eval(), client)]
    assert all(a != pytest.approx(softmax) for a in alternatives), (softmax, alternatives)


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_real_rounds_split_on_the_wire(federation, tmp_path, mode):
    run = federation.run(ROOT, {"method": "fedfac", "fedfac.mode": mode,
                                "fedfac.layers": "0,1", "fedfac.tau-quantile": 0.5,
                                "num-server-rounds": 3, "local-epochs": 1, "plot": False,
                                "fedfac.new-clients": 0.25, "output-dir": str(tmp_path)},
                       num_supernodes=4)
    assert run.ok, run.output[-3000:]
    results = read_results(tmp_path)
    rounds = results["rounds"]
    # partition 3 is a new client: never trained or evaluated in the rounds...
    assert all(r["train"]["num_clients"] == 3 for r in rounds)
    assert all(sorted(r["eval"]["per_client"]) == ["0", "1", "2"] for r in rounds)
    # ...then evaluated with LocalTrain and with the Ensemble of the 3 existing clients
    new = results["new_clients"]
    assert new["clients"] == ["3"] and new["ensemble_members"] == 3
    for name in ("localtrain", "ensemble"):
        assert 0.0 <= new[name]["per_client"]["3"] <= 1.0
        assert 0.0 <= new[name]["accuracy_task_mean"] <= 1.0
    # its traffic is counted, apart from the rounds': down, the shared part and then the
    # shared part with 3 members (more than a trained client's downlink); up, the members
    per_client_down = rounds[-1]["bytes_down_train"] / rounds[-1]["train"]["num_clients"]
    assert new["bytes_down"] > 2 * per_client_down and new["bytes_up"] > 0
    assert results["final"]["bytes_down_total"] == sum(r["bytes_down"] for r in rounds)
    assert all("dropped" not in r for r in rounds)   # uplink shapes matched the split
    analysed = [r["round"] for r in rounds if "fedfac" in r]
    assert analysed == ([1] if mode == "static" else [1, 2, 3])
    report = rounds[0]["fedfac"]["body.0"]
    assert report["num_shared"] == 16 and report["num_elements"] == 32
    if mode == "static":
        # after the split only shared rows go up: fewer bytes than the full layers of round 1
        assert rounds[1]["bytes_up"] < rounds[0]["bytes_up"]
        assert rounds[2]["bytes_up"] == rounds[1]["bytes_up"]
    else:
        assert rounds[1]["fedfac"]["body.0"]["kept_fraction"] is not None
    assert rounds[1]["bytes_down_train"] < rounds[0]["bytes_down_train"]
