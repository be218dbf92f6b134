"""FedDecomp: decomposed layers, alternating phases, what is shared, personal tau."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn
from torch.nn import functional as F

from client_app.runtime import Client
from common.config import ConfigError
from models.feddecomp import DecomposedConv2d, DecomposedLinear, is_personal_key
from server_app.app import initial_shared_arrays
from strategies.registry import load_settings
from strategies.training import LocalTraining
from tests.conftest import app_config, read_results

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_decomposed_linear_equals_base_at_init_then_adds_b_a():
    torch.manual_seed(0)
    base = nn.Linear(6, 4)
    layer = DecomposedLinear(base, ratio=0.5)
    assert layer.lora_B.shape == (6, 2) and layer.lora_A.shape == (2, 4)  # B: I x r, A: r x O
    x = torch.randn(5, 6)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)
    with torch.no_grad():
        layer.lora_B.normal_()
        layer.weight.add_(0.1)
    expected = F.linear(x, layer.weight + (layer.lora_B @ layer.lora_A).T, layer.bias)
    torch.testing.assert_close(layer(x), expected)
    assert not torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias))


def test_decomposed_conv_equals_base_at_init_then_adds_b_a_on_the_kernel_reshape():
    torch.manual_seed(0)
    base = nn.Conv2d(3, 4, 3, padding=1)
    layer = DecomposedConv2d(base, ratio=0.5)
    r = round(0.5 * 3 * 3)
    assert layer.lora_B.shape == (3 * 3, r) and layer.lora_A.shape == (r, 4 * 3)
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)
    with torch.no_grad():
        layer.lora_B.normal_()
    product = layer.lora_B @ layer.lora_A            # (I*K) x (O*K)
    tau = torch.empty(4, 3, 3, 3)
    for o in range(4):
        for i in range(3):
            for kr in range(3):
                for kc in range(3):
                    tau[o, i, kr, kc] = product[i * 3 + kr, o * 3 + kc]
    torch.testing.assert_close(layer.tau(), tau)
    torch.testing.assert_close(layer(x), F.conv2d(x, layer.weight + tau, layer.bias, padding=1))


def _client(tmp_path, pid=0, **overrides) -> Client:
    run_config = app_config(**{"method": "feddecomp", "local-epochs": 1,
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


@pytest.mark.parametrize(("lora_epochs", "changes"), [(1, "tau"), (0, "sigma")])
def test_each_phase_changes_only_its_parameters(tmp_path, lora_epochs, changes):
    client = _client(tmp_path, **{"feddecomp.lora-epochs": lora_epochs})
    received = initial_shared_arrays(client.settings)
    before = {k: v.clone() for k, v in client.model(received).named_parameters()}
    after = dict(_train(client, received).named_parameters())
    for name, value in after.items():
        moved = not torch.equal(before[name], value)
        if is_personal_key(name):
            assert moved == (changes == "tau"), name
        else:
            assert moved == (changes == "sigma"), name
    lora_b = [v for k, v in after.items() if k.endswith("lora_B")]
    assert any(v.abs().sum() > 0 for v in lora_b) == (changes == "tau")


def test_tau_is_personal_and_survives_rounds(tmp_path):
    client = _client(tmp_path)
    received = initial_shared_arrays(client.settings)
    assert not any(is_personal_key(k) for k in received)
    model = _train(client, received)
    client.keep_personal(model, received, client.shared_arrays(model, received))
    tau = {k: v.clone() for k, v in model.state_dict().items() if is_personal_key(k)}
    assert set(client.shared_arrays(model, received)) == set(received)
    next_round = client.model(received)  # the server's sigma, this client's own tau
    for key, value in tau.items():
        torch.testing.assert_close(next_round.state_dict()[key], value)


def test_lora_epochs_zero_reproduces_fedavg(tmp_path):
    fedavg = _client(tmp_path, method="fedavg")
    decomp = _client(tmp_path, **{"feddecomp.lora-epochs": 0})
    received_avg = initial_shared_arrays(fedavg.settings)
    received_dec = initial_shared_arrays(decomp.settings)
    assert set(received_avg) == set(received_dec)
    for key in received_avg:
        torch.testing.assert_close(received_avg[key].numpy(), received_dec[key].numpy())
    shared_avg = fedavg.shared_arrays(_train(fedavg, received_avg), received_avg)
    shared_dec = decomp.shared_arrays(_train(decomp, received_dec), received_dec)
    assert set(shared_avg) == set(shared_dec)
    for key in shared_avg:
        torch.testing.assert_close(shared_dec[key].numpy(), shared_avg[key].numpy(),
                                   rtol=1e-6, atol=1e-6)


def test_config_checks():
    with pytest.raises(ConfigError, match=r"feddecomp\.lora-epochs"):
        load_settings(app_config(**{"method": "feddecomp", "local-epochs": 2,
                                                  "feddecomp.lora-epochs": 3}))
    with pytest.raises(ConfigError, match=r"feddecomp\.rank-conv"):
        load_settings(app_config(**{"method": "feddecomp",
                                                  "feddecomp.rank-conv": 0.0}))


@pytest.mark.integration
def test_real_round_sends_fedavg_bytes_and_no_tau(federation, tmp_path):
    config = {"num-server-rounds": 2, "local-epochs": 2, "plot": False}
    bytes_up = {}
    for method in ("fedavg", "feddecomp"):
        out = tmp_path / method
        run = federation.run(ROOT, {**config, "method": method, "output-dir": str(out)},
                             num_supernodes=3)
        assert run.ok, run.output[-3000:]
        results = read_results(out)
        assert all("dropped" not in r for r in results["rounds"])  # keys == sigma keys
        assert all(r["train"]["num_clients"] == 3 for r in results["rounds"])
        bytes_up[method] = [r["bytes_up"] for r in results["rounds"]]
    assert bytes_up["feddecomp"] == bytes_up["fedavg"]
