"""Integration: differential privacy in real ``flwr run`` simulations (docs/privacy.md)."""

from __future__ import annotations

import pytest
from dp_accounting import dp_event
from dp_accounting.privacy_accountant import NeighboringRelation
from dp_accounting.rdp import RdpAccountant as ReferenceAccountant
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from strategies.engine.privacy import default_delta, local_epsilon
from tests.conftest import (
    REFERENCE,
    REFERENCE_CLIENTS,
    SharedRuns,
    check_results_schema,
    read_results,
)

pytestmark = pytest.mark.integration
NOISE = 1.0
# local DP noises every coordinate of every upload: at 1.0 the reference run's small model
# diverges within two rounds (its replies are then dropped for a non-finite loss)
LOCAL_NOISE = 0.02


@pytest.fixture(scope="module")
def private_runs(federation, tmp_path_factory) -> SharedRuns:
    return SharedRuns(federation, tmp_path_factory.mktemp("private-runs"))


def central_epsilon(rounds: int, delta: float) -> float:
    """dp-accounting's own epsilon: every one of 3 clients drawn, the accountant's noise
    multiplier half the run's (replace-one)."""
    accountant = ReferenceAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_event.SampledWithoutReplacementDpEvent(
        REFERENCE_CLIENTS, REFERENCE_CLIENTS, dp_event.GaussianDpEvent(NOISE / 2)), rounds)
    return accountant.get_epsilon(delta)


def test_a_central_dp_run_reports_its_budget_and_stops_before_passing_its_target(
        private_runs):
    """FedDecomp under central DP with a target epsilon between what 2 and 3 rounds spend:
    rounds 1-2 run, each with its epsilon (dp-accounting's), the run completes with the
    reason, and no reply was dropped (every clipped uplink fits the wire spec)."""
    delta = default_delta(REFERENCE_CLIENTS)
    target = (central_epsilon(2, delta) + central_epsilon(3, delta)) / 2
    run, out = private_runs.get({
        **REFERENCE, "method": "feddecomp", "dp.mode": "central", "dp.noise-multiplier": NOISE,
        "dp.target-epsilon": target, "tracking": "tensorboard"})
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    check_results_schema(results, "feddecomp", num_rounds=2, num_clients=REFERENCE_CLIENTS)
    assert results["status"] == "completed"
    assert results["reason"].startswith(f"dp.target-epsilon={target}: the next round would "
                                        f"spend epsilon {central_epsilon(3, delta):.3f}")
    spent = [r["privacy"] for r in results["rounds"]]
    assert [s["epsilon"] for s in spent] == pytest.approx(
        [central_epsilon(1, delta), central_epsilon(2, delta)], rel=1e-9)
    assert all(s["mode"] == "central" and s["clip_norm"] == 1.0 and s["delta"] == delta
               and 0 <= s["clipped_fraction"] <= 1 and s["clipped_by_server"] == 0
               for s in spent)
    assert results["final"]["privacy"] == spent[-1]
    assert all("dropped" not in r for r in results["rounds"])
    assert f"epsilon {spent[-1]['epsilon']:.3f} at delta 1e-05 (central DP)" in run.output
    # once, beside the first epsilon: what it bounds, and where it stands
    assert run.output.count("[privacy] epsilon ") == 1
    assert (f"[privacy] epsilon {spent[0]['epsilon']:.3g} at delta 1e-05: changing one client's "
            "data changes the odds of anything released by at most a factor of e^epsilon"
            in run.output)
    assert "[round 3/3] not run: dp.target-epsilon=" in run.output
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.value for e in events.Scalars("privacy/epsilon")] == pytest.approx(
        [s["epsilon"] for s in spent], rel=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_a_budget_stop_after_a_round_evaluate_every_skips_evaluates_that_round(
        private_runs, fused):
    """20 rounds at ``evaluate-every = 5`` would evaluate rounds 5 and 10-20; the target stops
    the run after round 3, which is then evaluated (by the clients drawn for it) so that the
    run ends with an accuracy, in one entry for round 3."""
    delta = default_delta(REFERENCE_CLIENTS)
    run, out = private_runs.get({
        **REFERENCE, "method": "fedavg", "dp.mode": "central", "dp.noise-multiplier": NOISE,
        "dp.target-epsilon": (central_epsilon(3, delta) + central_epsilon(4, delta)) / 2,
        "num-server-rounds": 20, "evaluate-every": 5, "fused-evaluation": fused})
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    assert results["status"] == "completed" and "[round 4/20] not run" in run.output
    assert [(r["round"], "eval" in r) for r in results["rounds"]] == [
        (1, False), (2, False), (3, True)]
    assert results["rounds"][-1]["eval"]["num_clients"] == REFERENCE_CLIENTS
    assert results["final"]["accuracy_weighted"] == results["rounds"][-1]["eval"][
        "accuracy_weighted"]


@pytest.mark.parametrize("method", ["pfedc", "factorized-fl", "fedfac"])
def test_local_dp_runs_every_method_that_sends_more_than_a_mean(private_runs, method):
    """The methods whose server reads each client's upload (branches, matching vectors,
    factor-analysis rows) run under local DP: every round's epsilon is the most-released
    client's, every noised uplink still fits the method's wire spec (no drop), and what the
    clients withheld and noised is what results.json says: no train loss, and by the end
    each client's 3 updates and its 3 evaluations' noised scores accounted, 6 releases."""
    _, results = private_runs.reference(method, **{"dp.mode": "local",
                                                   "dp.noise-multiplier": LOCAL_NOISE})
    check_results_schema(results, method, num_rounds=REFERENCE["num-server-rounds"],
                         num_clients=REFERENCE_CLIENTS)
    epsilons = [r["privacy"]["epsilon"] for r in results["rounds"]]
    assert epsilons == sorted(epsilons) and epsilons[0] > 0
    assert all(r["privacy"]["clipped_fraction"] is None for r in results["rounds"])
    assert all("dropped" not in r for r in results["rounds"])
    final = results["final"]["privacy"]
    assert (final["noised"], final["fixed"], final["exact_evaluation"]) == (
        ["accuracy", "task_accuracy"], ["num_examples"], [])
    releases = 2 * REFERENCE["num-server-rounds"]
    assert final["epsilon"] == pytest.approx(local_epsilon(
        LOCAL_NOISE / 2, releases, default_delta(REFERENCE_CLIENTS)), rel=1e-9)
    assert all("loss" not in r["train"] for r in results["rounds"])
