"""Fused evaluation (the evaluation after round r rides in round r+1's train messages) gives
exactly the per-client accuracies of the two-exchange protocol, with one exchange a round."""

from __future__ import annotations

import pytest

from tests.conftest import REFERENCE, REFERENCE_CLIENTS, app_config


@pytest.mark.integration
# FedALA and Ditto adapt the model where it arrives (Method.adapt), before the fused evaluation
@pytest.mark.parametrize("method", ["fedavg", "fedper", "feddecomp", "fedavg-ft", "fedala",
                                    "ditto"])
def test_fused_evaluation_equals_two_exchanges(shared_runs, method):
    two = shared_runs.reference(method, **{"fused-evaluation": False})[1]["rounds"]
    assert app_config()["fused-evaluation"] is True  # the reference run is the fused one
    one = shared_runs.reference(method)[1]["rounds"]
    rounds = REFERENCE["num-server-rounds"]
    assert [r["round"] for r in one] == list(range(1, rounds + 1))
    for separate, fused in zip(two, one, strict=True):
        assert fused["eval"]["per_client"] == separate["eval"]["per_client"]
        assert fused["eval"]["accuracy_task_mean"] == separate["eval"]["accuracy_task_mean"]
        assert fused["eval"]["num_clients"] == REFERENCE_CLIENTS
        assert fused["train"] == separate["train"]
        assert fused["bytes_up"] == separate["bytes_up"]
    # the evaluation of every round but the last travelled inside train messages: no
    # evaluate downlink; the last one is an exchange of its own
    assert [r["bytes_down_evaluate"] for r in one[:-1]] == [0] * (rounds - 1)
    assert one[-1]["bytes_down_evaluate"] == two[-1]["bytes_down_evaluate"] > 0


@pytest.mark.integration
@pytest.mark.parametrize(("method", "fused"), [
    ("fedavg", True), ("fedavg", False),
    # the servers that read each client's upload: matching, branches, factor analysis
    ("factorized-fl", True), ("pfedc", True), ("fedfac", True)])
def test_evaluating_every_other_round_leaves_training_and_the_evaluated_rounds_as_they_were(
        shared_runs, method, fused):
    """``evaluate-every = 2`` over 16 rounds: rounds 1, 3 and 5 are not evaluated (2, 4, 6
    and each of the last 10 are); one client of three trains a round, so the trainers are
    drawn after each evaluation draw, which is made in every round all the same. Every round
    trains as in the run that evaluates all, and every evaluated round scores as there."""
    base = {"num-server-rounds": 16, "fraction-train": 0.5, "fused-evaluation": fused}
    every = shared_runs.reference(method, **base)[1]
    sparse = shared_runs.reference(method, **base, **{"evaluate-every": 2})[1]
    assert [r["round"] for r in sparse["rounds"]] == list(range(1, 17))
    assert [r["round"] for r in sparse["rounds"] if "eval" in r] == [2, 4, *range(6, 17)]
    for full, thin in zip(every["rounds"], sparse["rounds"], strict=True):
        assert thin["train"] == full["train"] and thin["bytes_up"] == full["bytes_up"]
        if "eval" in thin:
            assert thin["eval"]["per_client"] == full["eval"]["per_client"]
    # no evaluate message went out for rounds 1, 3 and 5
    assert [sparse["rounds"][r - 1]["bytes_down_evaluate"] for r in (1, 3, 5)] == [0, 0, 0]
    assert all(every["rounds"][r - 1]["bytes_down_evaluate"] > 0 for r in (1, 3, 5))
    assert sparse["final"]["accuracy_weighted"] == every["final"]["accuracy_weighted"]
