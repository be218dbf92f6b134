"""The committed protocol v4 ``summary.json`` (bench/results/matrix-v4/matrix/) keeps what the
protocol promises for every row and claim it holds: the same rounds and local epochs within a
scenario, rounds chosen on validation, Factorized-FL's L1 on and its mu density reported, one
or two primary claims per paper method with their Holm-adjusted interval once measured, and no
row with an unstable seed in a scenario's pick. The re-run writes the file as cells arrive;
these checks hold for a partial file and for the whole one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.evidence.claims import PRIMARY
from bench.evidence.protocol import PAPER_METHODS, SCENARIOS

SUMMARY = Path(__file__).resolve().parents[1] / "bench" / "results" / "matrix-v4" / "matrix" \
    / "summary.json"


@pytest.fixture(scope="module")
def summary() -> dict:
    return json.loads(SUMMARY.read_text())


def test_its_rounds_are_chosen_on_validation_and_every_row_of_a_scenario_trains_alike(summary):
    assert summary["protocol"]["version"] == 4
    assert summary["protocol"]["rounds_chosen_on"] == "validation"
    assert set(summary["protocol"]["rounds"]) == set(SCENARIOS)
    for scenario, rounds in summary["protocol"]["rounds"].items():
        assert rounds["rounds_chosen_on"] == "validation", scenario
        rows = {k: r for k, r in summary["rows"].items() if k.startswith(f"{scenario}/")}
        assert len({r["local_epochs"] for r in rows.values()}) <= 1, scenario
        # every report seed ran R; before R was fixed, the base rounds (``--stage report``)
        assert {r["rounds"] for r in rows.values()} <= {rounds["rounds"] or rounds["base_rounds"]
                                                      }, scenario


def test_factorized_fl_keeps_its_sparse_mu_in_every_configuration_and_reports_its_density(
        summary):
    rows = {k: r for k, r in summary["rows"].items() if r["method"] == "factorized-fl"}
    for key, row in rows.items():
        assert all(c["factorized-fl.l1"] > 0 for c in [*row["grid"], row["chosen"]]), key
        assert row["mu_density"] is not None, (key, row.get("mu_density_missing"))


def test_every_paper_method_has_one_or_two_primary_claims_adjusted_once_measured(summary):
    """Per paper: FedFac's static and dynamic rows are one method (its primary claims are on
    the dynamic row, the mode its paper's later version recommends)."""
    claims = summary["claims"]
    assert {c["claim"] for c in claims if c["primary"]} == PRIMARY  # the file is today's
    for method in {e.method for e in PAPER_METHODS}:
        primary = [c for c in claims if c["method"].split("@")[0] == method and c["primary"]]
        assert 1 <= len(primary) <= 2, (method, [c["claim"] for c in primary])
    for claim in claims:
        # as Holm's procedure counts one measured (comparison/multiplicity.py)
        measured = claim["verdict"] != "not measured" and len(claim["paired_diffs"]) > 1
        assert (claim.get("ci95_adjusted") is not None) == (claim["primary"] and measured), \
            claim["claim"]


def test_every_scenario_with_a_row_has_a_pick_and_no_row_with_an_unstable_seed_is_in_it(
        summary):
    assert {key.split("/")[0] for key in summary["rows"]} <= set(summary["pick"])
    for scenario, pick in summary["pick"].items():
        for label in filter(None, [pick["run"], *pick["also"]]):
            assert summary["rows"][f"{scenario}/{label}"]["unstable_seeds"] == [], \
                (scenario, label)
