"""Fused evaluation (the evaluation after round r rides in round r+1's train messages) gives
exactly the per-client accuracies of the two-exchange protocol, with one exchange a round."""

from __future__ import annotations

import pytest

from tests.conftest import REFERENCE, REFERENCE_CLIENTS, app_config


@pytest.mark.integration
@pytest.mark.parametrize("method", ["fedavg", "fedper", "feddecomp", "fedavg-ft"])
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
