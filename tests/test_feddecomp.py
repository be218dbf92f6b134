"""FedDecomp: decomposed layers, alternating phases, what is shared, personal tau."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from torch import nn
from torch.nn import functional as F

from client_app.runtime import Client
from common.config import ConfigError
from common.protocol import ClientReply
from models.feddecomp import DecomposedConv2d, DecomposedLinear, is_personal_key
from strategies.engine import RoundEngine
from strategies.feddecomp.server import FedDecompRule
from strategies.registry import build_model, initial_state, load_settings, wire_spec
from strategies.training import LocalTraining
from tests.conftest import REFERENCE_CLIENTS, app_config, moves_per_epoch


@pytest.mark.parametrize("scaled", [False, True])
def test_decomposed_linear_equals_base_at_init_then_adds_b_a(scaled):
    """``tau = (B A)^T``, times ``1/r`` unless ``feddecomp.tau-scale = "none"``."""
    torch.manual_seed(0)
    base = nn.Linear(6, 4)
    layer = DecomposedLinear(base, 0.5, "inverse-rank" if scaled else "none")
    assert layer.lora_B.shape == (6, 2) and layer.lora_A.shape == (2, 4)  # B: I x r, A: r x O
    x = torch.randn(5, 6)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)
    with torch.no_grad():
        layer.lora_B.normal_()
        layer.weight.add_(0.1)
    factor = 1 / 2 if scaled else 1.0
    expected = F.linear(x, layer.weight + factor * (layer.lora_B @ layer.lora_A).T, layer.bias)
    torch.testing.assert_close(layer(x), expected)
    assert not torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("scaled", [False, True])
def test_decomposed_conv_equals_base_at_init_then_adds_b_a_on_the_kernel_reshape(scaled):
    torch.manual_seed(0)
    base = nn.Conv2d(3, 4, 3, padding=1)
    layer = DecomposedConv2d(base, 0.5, "inverse-rank" if scaled else "none")
    r = round(0.5 * 3 * 3)
    assert layer.lora_B.shape == (3 * 3, r) and layer.lora_A.shape == (r, 4 * 3)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)
    with torch.no_grad():
        layer.lora_B.normal_()
    product = (layer.lora_B @ layer.lora_A) / (r if scaled else 1)  # (I*K) x (O*K)
    tau = torch.empty(4, 3, 3, 3)
    for o in range(4):
        for i in range(3):
            for kr in range(3):
                for kc in range(3):
                    tau[o, i, kr, kc] = product[i * 3 + kr, o * 3 + kc]
    torch.testing.assert_close(layer.tau(), tau)
    torch.testing.assert_close(layer(x), F.conv2d(x, layer.weight + tau, layer.bias, padding=1))


# LeNet-5's conv1, conv2, fc1, fc2 and head at rank-conv 0.5: the authors' loralib counts a
# conv's r as int(0.5 * out channels) (6, 16) and a Linear's as its absolute rank (4);
# "inverse-rank" divides by this project's ranks (rank-linear 0.5 as a ratio)
LENET5_SCALES = {"authors": (4, [1 / 3, 1 / 8, 1 / 4, 1 / 4, 1 / 4]),
                 "inverse-rank": (0.5, [1 / 2, 1 / 15, 1 / 60, 1 / 42, 1 / 5]),
                 "none": (4, [1.0] * 5)}


@pytest.mark.parametrize("tau_scale", list(LENET5_SCALES))
def test_lenet5_scales_tau_per_layer_as_each_rule_counts_r(tau_scale):
    rank_linear, scales = LENET5_SCALES[tau_scale]
    overrides = {"model": "lenet5", "dataset": "fashion-mnist", "feddecomp.rank-conv": 0.5,
                 "feddecomp.rank-linear": rank_linear, "feddecomp.tau-scale": tau_scale}
    settings = load_settings(app_config(method="feddecomp", **overrides))
    layers = [m for m in build_model(settings).modules()
              if isinstance(m, DecomposedLinear | DecomposedConv2d)]
    assert [m.scale for m in layers] == pytest.approx(scales)


def test_the_authors_scale_is_the_default_and_an_integer_linear_rank_is_absolute():
    settings = load_settings(app_config(method="feddecomp"))
    assert settings.method_settings.tau_scale == "authors"
    linear = [m for m in build_model(settings).modules() if isinstance(m, DecomposedLinear)]
    assert linear and all(m.rank == 4 and m.scale == 1 / 4 for m in linear)
    ratio = load_settings(app_config(method="feddecomp", **{"feddecomp.rank-linear": 1.0}))
    head = build_model(ratio).head
    assert head.rank == min(head.in_features, head.out_features)


def test_a_linear_ratio_above_one_stops_with_one_line():
    with pytest.raises(ConfigError, match=r"feddecomp.rank-linear: 4.0 .* integer rank"):
        build_model(load_settings(app_config(method="feddecomp",
                                             **{"feddecomp.rank-linear": 4.0})))


def _client(tmp_path, pid=0, **overrides) -> Client:
    run_config = app_config(**{"method": "feddecomp", "local-epochs": 2,
                               "feddecomp.lora-epochs": 1, "partitioner": "iid", **overrides})
    return Client.from_context(Context(
        run_id=1, node_id=pid, node_config={"partition-id": pid, "num-partitions": 4},
        state=RecordDict(), run_config=run_config))


def _train(client: Client, received: ArrayRecord, server_round: int = 1):
    model = client.model(received)
    torch.manual_seed(server_round)
    client.method.local_train(LocalTraining(model, client.loader(True, server_round),
                                            client.settings, client.device, server_round))
    return model


def test_phase_one_trains_only_tau_then_phase_two_only_sigma(tmp_path):
    """local-epochs 2, lora-epochs 1: in epoch 1 only ``A``, ``B`` move (``sigma``, biases
    and BatchNorm affine frozen); in epoch 2 the reverse."""
    client = _client(tmp_path, **{"local-epochs": 2, "feddecomp.lora-epochs": 1})
    (first, second), names = moves_per_epoch(client)
    tau = {k for k in names if is_personal_key(k)}
    sigma = names - tau
    assert tau and any(k.endswith("lora_B") for k in tau) and sigma
    assert first == tau           # every A and B moved (B from zero), nothing else
    assert second == sigma        # every sigma, bias and BN affine moved, no tau


def test_tau_is_personal_and_survives_rounds(tmp_path):
    client = _client(tmp_path)
    received = initial_state(client.settings).arrays
    assert not any(is_personal_key(k) for k in received)
    model = _train(client, received)
    client.keep_personal(model, received, client.shared_arrays(model, received))
    tau = {k: v.clone() for k, v in model.state_dict().items() if is_personal_key(k)}
    assert set(client.shared_arrays(model, received)) == set(received)
    next_round = client.model(received)  # the server's sigma, this client's own tau
    for key, value in tau.items():
        torch.testing.assert_close(next_round.state_dict()[key], value)


@pytest.mark.parametrize("bn_stats", ["shared", "personal"])
def test_batchnorm_statistics_shared_by_default_personal_as_the_option(tmp_path, bn_stats):
    overrides = {} if bn_stats == "shared" else {"feddecomp.bn-stats": bn_stats}
    client = _client(tmp_path, **overrides)
    received = initial_state(client.settings).arrays
    stats = [k for k in client.method.build_model(client.settings).state_dict()
             if "running_" in k]
    assert stats and (set(stats) <= set(received)) == (bn_stats == "shared")
    assert not set(stats) & set(received) or bn_stats == "shared"
    model = _train(client, received)
    sent = client.shared_arrays(model, received)
    assert (set(stats) <= set(sent)) == (bn_stats == "shared")
    client.keep_personal(model, received, sent)
    next_round = client.model(received).state_dict()
    for key in stats:  # personal: this client's own statistics come back, not the initial ones
        kept = torch.equal(next_round[key], model.state_dict()[key])
        assert kept == (bn_stats == "personal"), key


def test_lora_epochs_zero_reproduces_fedavg(tmp_path):
    fedavg = _client(tmp_path, method="fedavg")
    decomp = _client(tmp_path, **{"feddecomp.lora-epochs": 0})
    received_avg = initial_state(fedavg.settings).arrays
    received_dec = initial_state(decomp.settings).arrays
    assert set(received_avg) == set(received_dec)
    for key in received_avg:
        torch.testing.assert_close(received_avg[key].numpy(), received_dec[key].numpy())
    shared_avg = fedavg.shared_arrays(_train(fedavg, received_avg), received_avg)
    shared_dec = decomp.shared_arrays(_train(decomp, received_dec), received_dec)
    assert set(shared_avg) == set(shared_dec)
    for key in shared_avg:
        torch.testing.assert_close(shared_dec[key].numpy(), shared_avg[key].numpy(),
                                   rtol=1e-6, atol=1e-6)


def _reply(client_id: str, value: float, examples: int) -> ClientReply:
    arrays = ArrayRecord({"body.0.weight": Array(np.full((2, 3), value, np.float32)),
                          "body.1.running_mean": Array(np.full(2, value, np.float32))})
    return ClientReply(int(client_id), client_id, arrays,
                       MetricRecord({"num-examples": examples}), ConfigRecord({}))


@pytest.mark.parametrize(("weighting", "expected"), [("uniform", (1.0 + 5.0) / 2),
                                                     ("examples", (1.0 * 1 + 5.0 * 3) / 4)])
def test_server_mean_is_uniform_over_clients_by_default(weighting, expected):
    overrides = {} if weighting == "uniform" else {"feddecomp.weighting": weighting}
    settings = load_settings(app_config(method="feddecomp", **overrides))
    assert settings.method_settings.weighting == weighting
    rule = RoundEngine(settings, wire_spec(settings), FedDecompRule).rule
    replies = [_reply("0", 1.0, 1), _reply("1", 5.0, 3)]
    start = ArrayRecord({"body.0.weight": Array(np.zeros((2, 3), np.float32)),
                         "body.1.running_mean": Array(np.zeros(2, np.float32))})
    merged = rule.merge_updates(1, replies, start)
    for key in ("body.0.weight", "body.1.running_mean"):
        np.testing.assert_allclose(merged[key].numpy(), expected)
        assert merged[key].numpy().dtype == np.float32


def test_defaults_are_the_authors_ranks_and_leave_sigma_epochs():
    """Ranks pinned to the authors' own CIFAR-10 command (README of ``XinghaoWu/FedDecomp``:
    ``--Conv_r=0.6 --Linear_r=4``; their code's conv rank is a ratio, their Linear rank an
    absolute one, as here). ``feddecomp.lora-epochs``: the paper
    and the code train ``tau`` 2 of 5 local epochs (``--local_p_ep 2``, ``--local_ep 5``); with
    this project's ``local-epochs = 2`` a default of 2 would never train ``sigma`` (nothing
    shared would move), so the default is 1 of 2 and the paper's split is
    ``local-epochs=5 feddecomp.lora-epochs=2``."""
    settings = load_settings(app_config(method="feddecomp"))
    options = settings.method_settings
    assert (options.rank_conv, settings.raw["feddecomp.rank-linear"]) == (0.6, 4)
    assert options.lora_epochs == 1 < settings.local_epochs == 2
    paper = load_settings(app_config(**{"method": "feddecomp", "local-epochs": 5,
                                        "feddecomp.lora-epochs": 2}))
    assert paper.local_epochs - paper.method_settings.lora_epochs == 3
    head = build_model(settings).head
    assert isinstance(head, DecomposedLinear) and head.rank == 4


def test_lora_epochs_that_leave_sigma_untrained_stop_at_start():
    """``lora-epochs = local-epochs`` would train only ``tau``: the shared ``sigma`` would
    never move and the federation would learn nothing; the run stops with one line."""
    with pytest.raises(ConfigError, match=r"^feddecomp\.lora-epochs: 2 leaves no epoch of "
                                          r"local-epochs=2 to the shared part; allowed: "
                                          r"\[0, 1\]$"):
        load_settings(app_config(**{"method": "feddecomp", "local-epochs": 2,
                                    "feddecomp.lora-epochs": 2}))


def test_config_checks():
    with pytest.raises(ConfigError, match=r"feddecomp\.lora-epochs: 3 leaves no epoch"):
        load_settings(app_config(**{"method": "feddecomp", "local-epochs": 2,
                                                  "feddecomp.lora-epochs": 3}))
    with pytest.raises(ConfigError, match=r"feddecomp\.rank-conv"):
        load_settings(app_config(**{"method": "feddecomp",
                                                  "feddecomp.rank-conv": 0.0}))


@pytest.mark.integration
def test_real_round_sends_fedavg_bytes_and_no_tau(shared_runs):
    bytes_up = {}
    for method in ("fedavg", "feddecomp"):
        _, results = shared_runs.reference(method)
        assert all("dropped" not in r for r in results["rounds"])  # keys == sigma keys
        assert all(r["train"]["num_clients"] == REFERENCE_CLIENTS for r in results["rounds"])
        bytes_up[method] = [r["bytes_up"] for r in results["rounds"]]
    assert bytes_up["feddecomp"] == bytes_up["fedavg"]
