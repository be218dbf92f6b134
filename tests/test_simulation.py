"""Integration: real ``flwr run`` simulations on a private SuperLink (no mocks)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from flwr.app import ArrayRecord

from launch.federation import LocalFederation
from launch.processes import stop_process_groups
from strategies.registry import build_model, load_settings
from tests.conftest import (
    REFERENCE,
    REFERENCE_CLIENTS,
    USER_CODE,
    app_config,
    check_results_schema,
    copy_app,
    read_results,
    run_in_background,
    wait_for,
)

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
BASELINES = ["fedavg", "fedprox", "local", "fedper", "fedrep", "fedbn"]


def quick(out_dir: Path, **overrides) -> dict:
    return {"num-server-rounds": 2, "local-epochs": 1, "output-dir": str(out_dir),
            "plot": False, **overrides}


@pytest.mark.parametrize("method", BASELINES)
def test_baseline_runs_its_rounds_with_every_client(shared_runs, method):
    run, results = shared_runs.reference(method)
    check_results_schema(results, method, num_rounds=REFERENCE["num-server-rounds"],
                         num_clients=REFERENCE_CLIENTS)
    assert "[progress] round   2" in run.output
    rounds = results["rounds"]
    if method == "local":
        assert results["final"]["bytes_up_total"] == 0
        assert results["final"]["bytes_down_total"] == 0
    else:
        assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rounds)
        # what goes down to a client is what comes back up: the same shared keys
        assert all(r["bytes_up"] == r["bytes_down_train"] for r in rounds)


def test_shared_bytes_match_the_shared_keys(shared_runs):
    """FedPer sends exactly FedAvg's payload minus the head, counted by count_bytes()."""
    sizes = {method: shared_runs.reference(method)[1]["rounds"][0]["bytes_up"]
             for method in ("fedavg", "fedper")}
    model = build_model(load_settings({**app_config(), "method": "fedavg",
                                       "model": REFERENCE["model"]}))
    head = ArrayRecord({k: v for k, v in model.state_dict().items() if k.startswith("head.")})
    assert head.count_bytes() > (32 * 10 + 10) * 4  # the user's classifier: Linear(32, 10)
    assert sizes["fedavg"] - sizes["fedper"] == REFERENCE_CLIENTS * head.count_bytes()


FAULTY_CLIENT = '''
"""A ClientApp whose partition 0 trains to NaN, partition 1 replies with a wrong shape and
partition 2 evaluates to a NaN loss."""
import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.clientapp import ClientApp

from client_app.app import evaluate_personalized, query, train


def corrupt(msg, context, call_next):
    reply = call_next(msg, context)
    pid = int(context.node_config["partition-id"])
    if msg.metadata.message_type == "evaluate" and pid == 2:
        reply.content["metrics"]["loss"] = float("nan")
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
    *rounds, last = results["rounds"]
    for entry in results["rounds"]:
        assert entry["train"]["num_clients"] == 2
        reasons = {(d["stage"], d["reason"]) for d in entry["dropped"]}
        assert ("train", "'body.0.weight' has values that are not finite") in reasons
        assert "shape" in " ".join(reason for _, reason in reasons)
    for entry in rounds:  # evaluated with the next round's training: reaches everyone
        assert entry["eval"]["num_clients"] == 4
    # the last evaluation is its own exchange, where partition 2's loss is NaN
    assert ("evaluate", "metric 'loss' is not finite") in {
        (d["stage"], d["reason"]) for d in last["dropped"]}
    assert last["eval"]["num_clients"] == 3
    assert run.output.count("dropped reply of node") >= 4
    # the final figure is over the clients left and the last round trained without one:
    # the run says both under it
    final = [line.split("[final] ", 1)[1] for line in run.output.splitlines()
             if "[final] round " in line]
    assert final == [
        f"round {last['round']}: the replies of 1 client(s) were not finite (metric 'loss' "
        "is not finite): the accuracy above is over the other clients only",
        f"round {last['round']}: the replies of 1 client(s) were not finite ('body.0.weight' "
        "has values that are not finite): their updates were left out of the shared model "
        "(where training diverged, a lower lr or less DP noise helps)"], final


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


def test_an_app_flower_cannot_bundle_is_not_started_and_says_why(federation, tmp_path):
    """What ``flwr run`` refuses (its bundle's check of ``pyproject.toml``) is refused the
    same way in-process: no run, returncode 1 and Flower's reason."""
    app = copy_app(tmp_path / "app")
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('serverapp = "', 'serverap = "', 1))
    before = {run["run-id"] for run in federation.runs()}
    run = federation.flwr_run(app, quick(tmp_path), federation.federation_config(2, 1, 0.0))
    assert (run.returncode, run.run_id, run.status) == (1, None, "")
    assert "serverapp" in run.output, run.output
    assert {run["run-id"] for run in federation.runs()} == before


def test_a_run_past_its_timeout_is_stopped(federation, tmp_path):
    """A run that has not ended within the launcher's timeout is not left running beside
    the next one: the launcher stops it and says so."""
    run = federation.run(ROOT, quick(tmp_path, **{"num-server-rounds": 200}),
                         num_supernodes=2, timeout=8)
    assert run.returncode == 124 and not run.ok
    assert "no end within 8 s" in run.output
    wait_for(lambda: federation.runs(run.run_id)[0]["status"].startswith("finished"), 60)
    assert federation.runs(run.run_id)[0]["status"] == "finished:stopped"


def test_a_run_whose_superlink_exits_ends_at_once_and_says_so(tmp_path):
    """Not the run's timeout later (4 hours for the compare command): the launcher sees the
    SuperLink it started exit and returns. A federation of its own: its SuperLink is
    stopped, with every process it started, in the middle of a run."""
    with LocalFederation(home=tmp_path / "flwr") as own:
        runner, result = run_in_background(own, quick(tmp_path, **{"num-server-rounds": 200}))
        wait_for(lambda: any(r["status"] == "running" for r in own.runs()), 120, poll=0.2)
        stop_process_groups(own.process, 5)
        stopped = time.monotonic()
        runner.join(60)
        assert not runner.is_alive()
        assert time.monotonic() - stopped < 10
    run = result["run"]
    assert run.returncode == 1 and not run.ok
    assert "the SuperLink exited during the run" in run.output
    assert run.reason.startswith("the SuperLink exited")  # what the compare command reports


def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(shared_runs):
    rounds = REFERENCE["num-server-rounds"]
    _, expected = shared_runs.reference("fedavg")
    first, first_out = shared_runs.get({**REFERENCE, "method": "fedavg",
                                        "num-server-rounds": rounds - 1})
    assert first.ok, first.output[-3000:]
    resumed, got = shared_runs.reference("fedavg", **{"resume-from": str(first_out)})
    assert f"[resume] from round {rounds - 1}" in resumed.output
    assert [r["round"] for r in got["rounds"]] == list(range(1, rounds + 1))
    for a, b in zip(expected["rounds"], got["rounds"], strict=True):
        assert a["eval"]["per_client"] == b["eval"]["per_client"]
        assert a["train"]["loss"] == b["train"]["loss"]
        assert a["bytes_up"] == b["bytes_up"]
    assert expected["final"]["accuracy_weighted"] == got["final"]["accuracy_weighted"]


def test_a_window_of_one_message_in_flight_gives_the_same_run(shared_runs):
    """``max-in-flight = 1``: every exchange sends its messages one after another, each once
    the previous one is answered; every round reaches every client and the results equal a
    run that sends them all at once (the default window is wider than the federation)."""
    assert app_config()["max-in-flight"] > REFERENCE_CLIENTS
    one_at_a_time = shared_runs.reference("fedavg", **{"max-in-flight": 1})[1]["rounds"]
    all_at_once = shared_runs.reference("fedavg")[1]["rounds"]
    for one, many in zip(one_at_a_time, all_at_once, strict=True):
        assert one["train"] == many["train"]
        assert one["eval"]["per_client"] == many["eval"]["per_client"]
        assert one["eval"]["num_clients"] == REFERENCE_CLIENTS and not one.get("dropped")


def test_a_warm_run_equals_a_cold_run_of_the_same_seed(shared_runs, tmp_path):
    """The session's runs join one Ray head kept up between them (``launch/ray_head.py``);
    a cold run (its own SuperLink, and a private Ray instance started and stopped with it) of
    the same config gives the same results."""
    assert shared_runs.federation.ray_address is not None  # the shared runs are warm
    warm = shared_runs.reference("fedavg")[1]
    with LocalFederation(pythonpath=[USER_CODE]) as cold_federation:
        cold = cold_federation.run(ROOT, {**REFERENCE, "method": "fedavg",
                                          "output-dir": str(tmp_path)},
                                   num_supernodes=REFERENCE_CLIENTS)
    assert cold.ok, cold.output[-3000:]
    for a, b in zip(warm["rounds"], read_results(tmp_path)["rounds"], strict=True):
        assert a["eval"]["per_client"] == b["eval"]["per_client"]
        assert a["train"] == b["train"]
        assert (a["bytes_up"], a["bytes_down"]) == (b["bytes_up"], b["bytes_down"])
