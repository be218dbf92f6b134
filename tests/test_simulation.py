"""Integration: real ``flwr run`` simulations on a private SuperLink (no mocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import ArrayRecord

from strategies.registry import build_model, load_settings
from tests.conftest import app_config, check_results_schema, copy_app, read_results

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
BASELINES = ["fedavg", "fedprox", "local", "fedper", "fedrep", "fedbn"]


def quick(out_dir: Path, **overrides) -> dict:
    return {"num-server-rounds": 2, "local-epochs": 1, "output-dir": str(out_dir),
            "plot": False, **overrides}


@pytest.mark.parametrize("method", BASELINES)
def test_baseline_runs_two_rounds_with_four_clients(federation, tmp_path, method):
    run = federation.run(ROOT, quick(tmp_path, method=method), num_supernodes=4)
    assert run.ok, run.output[-3000:]
    results = read_results(tmp_path)
    check_results_schema(results, method, num_rounds=2, num_clients=4)
    assert "[progress] round   2" in run.output
    rounds = results["rounds"]
    if method == "local":
        assert results["final"]["bytes_up_total"] == 0
        assert results["final"]["bytes_down_total"] == 0
    else:
        assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rounds)
        # what goes down to a client is what comes back up: the same shared keys
        assert all(r["bytes_up"] == r["bytes_down_train"] for r in rounds)


def test_shared_bytes_match_the_shared_keys(federation, tmp_path):
    """FedPer sends exactly FedAvg's payload minus the head, counted by count_bytes()."""
    sizes = {}
    for method in ("fedavg", "fedper"):
        out = tmp_path / method
        run = federation.run(ROOT, quick(out, method=method, **{"num-server-rounds": 1}),
                             num_supernodes=2)
        assert run.ok, run.output[-3000:]
        sizes[method] = read_results(out)["rounds"][0]["bytes_up"]
    model = build_model(load_settings({**app_config(), "method": "fedavg"}))
    head = ArrayRecord({k: v for k, v in model.state_dict().items() if k.startswith("head.")})
    assert head.count_bytes() > (128 * 10 + 10) * 4  # cnn head: Linear(128, 10), float32
    assert sizes["fedavg"] - sizes["fedper"] == 2 * head.count_bytes()  # two clients


FAULTY_CLIENT = '''
"""A ClientApp whose partition 0 replies with NaN and partition 1 with a wrong shape."""
import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.clientapp import ClientApp

from client_app.app import evaluate_personalized, query, train


def corrupt(msg, context, call_next):
    reply = call_next(msg, context)
    pid = int(context.node_config["partition-id"])
    if msg.metadata.message_type != "train" or pid > 1:
        return reply
    arrays = reply.content["arrays"]
    key = next(iter(arrays.keys()))
    value = arrays[key].numpy().copy()
    if pid == 0:
        value.flat[0] = np.nan
    else:
        value = np.zeros((3,) + value.shape, value.dtype)
    arrays[key] = Array(value)
    return reply


app = ClientApp(mods=[corrupt])
app.train()(train)
app.evaluate()(evaluate_personalized)
app.query()(query)
'''


def test_bad_replies_are_dropped_and_logged_and_the_run_completes(federation, tmp_path):
    app_dir = copy_app(tmp_path / "app")
    (app_dir / "faulty_client.py").write_text(FAULTY_CLIENT)  # shipped: named in fab-include
    pyproject = app_dir / "pyproject.toml"
    pyproject.write_text(pyproject.read_text()
                         .replace('"client_app.app:app"', '"faulty_client:app"')
                         .replace("fab-include = [", 'fab-include = ["faulty_client.py", '))
    out = tmp_path / "out"
    run = federation.run(app_dir, quick(out), num_supernodes=4)
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    for entry in results["rounds"]:
        assert entry["train"]["num_clients"] == 2
        reasons = {d["client"]: d["reason"] for d in entry["dropped"]}
        assert "non-finite" in " ".join(reasons.values())
        assert "shape" in " ".join(reasons.values())
        assert entry["eval"]["num_clients"] == 4  # evaluation still reaches everyone
    assert run.output.count("dropped reply of node") >= 4
    assert "non-finite values" in run.output


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("method", "fedfoo", "allowed: fedavg, fedprox, local, fedper, fedrep, fedbn"),
    ("dataset", "imagenet", "allowed: digits, synthetic-fedfac, mnist"),
])
def test_unknown_method_or_dataset_fails_at_start(federation, tmp_path, key, value, allowed):
    """The ServerApp's own check (a plain ``flwr run``: no launcher checked the config)."""
    run = federation.flwr_run(ROOT, quick(tmp_path, **{key: value}),
                              federation.federation_config(2, 1, 0.0))
    assert run.status == "finished:failed"
    assert run.reason.startswith(f"{key}: unknown value '{value}'")
    lines = [line for line in run.output.splitlines() if "Invalid run config" in line]
    assert lines and f"{key}: unknown value '{value}'" in lines[0] and allowed in lines[0]
    assert not (tmp_path / "results.json").exists()


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(federation, tmp_path):
    base = {"method": "fedavg", "local-epochs": 1, "plot": False}
    full, first, resumed = tmp_path / "full", tmp_path / "first", tmp_path / "resumed"
    runs = [federation.run(ROOT, {**base, "num-server-rounds": 4, "output-dir": str(full)},
                           num_supernodes=3),
            federation.run(ROOT, {**base, "num-server-rounds": 2, "output-dir": str(first)},
                           num_supernodes=3),
            federation.run(ROOT, {**base, "num-server-rounds": 4, "output-dir": str(resumed),
                                  "resume-from": str(first)}, num_supernodes=3)]
    assert all(run.ok for run in runs), [r.output[-2000:] for r in runs if not r.ok]
    assert "[resume] from round 2" in runs[2].output
    expected, got = read_results(full), read_results(resumed)
    assert [r["round"] for r in got["rounds"]] == [1, 2, 3, 4]
    for a, b in zip(expected["rounds"], got["rounds"], strict=True):
        assert a["eval"]["per_client"] == b["eval"]["per_client"]
        assert a["train"]["loss"] == b["train"]["loss"]
        assert a["bytes_up"] == b["bytes_up"]
    assert expected["final"]["accuracy_weighted"] == got["final"]["accuracy_weighted"]


def test_a_window_of_one_message_in_flight_gives_the_same_run(federation, tmp_path):
    """``max-in-flight = 1``: every exchange sends its messages one after another, each once
    the previous one is answered; every round reaches every client and the results equal a
    run that sends them all at once."""
    results = {}
    for window in (1, 100):
        out = tmp_path / str(window)
        run = federation.run(ROOT, quick(out, **{"max-in-flight": window}), num_supernodes=4)
        assert run.ok, run.output[-3000:]
        results[window] = read_results(out)["rounds"]
    for one, many in zip(results[1], results[100], strict=True):
        assert one["train"] == many["train"]
        assert one["eval"]["per_client"] == many["eval"]["per_client"]
        assert one["eval"]["num_clients"] == 4 and not one.get("dropped")
