"""The evidence matrix's verdicts (bench/evidence/claims.py, report.py): claims judged on the
paired interval against the strongest reference on validation, ablations as paired
differences, cell names (on five seeds here: the rules do not depend on their number; the
primary family, picks and unstable seeds: tests/test_matrix_v4_verdicts.py)."""

from __future__ import annotations

import re
import statistics

import pytest

from bench.evidence import protocol
from bench.evidence.claims import claim_line, claims
from bench.evidence.stats import flag
from bench.evidence.tables import ablation_table
from comparison.stats import CONVERGED_SLOPE, config_tag, converged, judge_difference
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def five_seeds(monkeypatch):
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1, 2, 3, 4, 5))


def _row(per_seed: list[float], mb_up: float = 10.0, tuned: bool = True,
         num_rounds: int = 40, task: list[float] | None = None,
         slopes: list[float] | None = None, validation: float | None = None) -> dict:
    """A row as ``row_stats`` gives it, from its per-seed figures (seeds 1, 2, ...), its task
    accuracy the same as its accuracy unless ``task`` is given, its curves flat (converged)
    unless ``slopes`` are given, its validation figures its means unless ``validation``."""
    task = per_seed if task is None else task
    slopes = [0.0] * len(per_seed) if slopes is None else slopes
    return {"per_seed": {seed: {"accuracy": a, "task_accuracy": t, "slope": s}
                         for seed, (a, t, s) in enumerate(zip(per_seed, task, slopes,
                                                              strict=True), 1)},
            "accuracy": (statistics.fmean(per_seed), 0.0), "mb_up": (mb_up, 0.0),
            "slope": (statistics.fmean(slopes), 0.0),
            "seeds": len(per_seed), "tuned": tuned, "num_rounds": num_rounds,
            "diverged_seeds": [], "unstable_seeds": [], "unstable_why": {},
            "validation": {"accuracy": statistics.fmean(per_seed) if validation is None
                           else validation, "task_accuracy": statistics.fmean(task)}}


def test_a_cell_of_a_two_key_config_is_named_without_a_comma():
    # Flower's FAB manifest is comma-separated: such a name under the app breaks `flwr run .`
    path = protocol.cell_path(ROOT, "dirichlet-0.1", "fedfac@dynamic", "tune",
                            {"lr": 0.02, "fedfac.tau-quantile": 0.3}, 0)
    assert "," not in path.name and "lr=0.02" in path.name


def test_claims_are_judged_on_the_paired_interval_against_the_strongest_reference():
    base = [0.60, 0.62, 0.58, 0.61, 0.59]

    def shifted(by: list[float]) -> list[float]:
        return [b + d for b, d in zip(base, by, strict=True)]

    stats = {
        "dirichlet-0.1": {
            "fedavg": _row(base),
            # +6 points on every seed, give or take 0.3: the interval clears +5
            "feddecomp": _row(shifted([0.060, 0.063, 0.057, 0.061, 0.059])),
            "fedper": _row(shifted([0.065] * 5)), "fedrep": _row(shifted([0.10] * 5)),
            # +6 points on average, but one seed -4: the interval does not clear +3
            "fedfac": _row(shifted([0.10, 0.10, -0.04, 0.08, 0.06])),
        },
        "permuted-labels": {"factorized-fl": _row(shifted([0.0] * 5), mb_up=0.4),
                            "local": _row(shifted([0.002, -0.001, 0.0, 0.001, 0.0])),
                            "fedavg": _row(base, mb_up=10.0)},
        "pathological-2": {"pfedc": _row(shifted([0.3] * 5)), "fedavg": _row(base),
                           "fedrep": _row(shifted([0.3] * 5)[:4])},  # 4 seeds of 5
    }
    same_size = config_tag(protocol.SAME_SIZE_RANDOM_SPLIT)
    ablated = {("dirichlet-0.1", "fedfac", same_size): {
        "seeds": 5, "per_seed": stats["dirichlet-0.1"]["fedfac"]["per_seed"],
        "diverged_seeds": []}}
    judged = {c["claim"]: c for c in claims(stats, ablated)}
    decomp = judged["FedDecomp >= FedAvg + 5 points on Dirichlet 0.1"]
    assert decomp["verdict"] == "held" and decomp["reference"] == "fedavg"
    assert decomp["ci95"][0] >= 0.05 and len(decomp["paired_diffs"]) == 5
    assert abs(decomp["mean_diff"] - 0.06) < 1e-9
    # judged against the stronger of FedPer and FedRep: FedRep, +10 points
    best = judged["FedDecomp not below the best of FedPer/FedRep by more than 1 point"]
    assert best["reference"] == "fedrep" and best["verdict"] == "did not hold"
    fedfac = judged["FedFac (fedfac) >= FedAvg + 3 points on Dirichlet 0.1"]
    assert fedfac["mean_diff"] >= 0.03 and fedfac["verdict"] == "did not hold"
    assert fedfac["interval"] == "across the margin"
    assert decomp["interval"] == "above the margin" and best["interval"] == "below the margin"
    # equal to its same-size random split on every seed: an interval of [0, 0] clears -1
    split = ("FedFac ({}) split not below a random split of the same size by more than 1 point "
             "on Dirichlet 0.1")
    assert judged[split.format("fedfac")]["verdict"] == "held"
    assert judged[split.format("fedfac@dynamic")]["verdict"] == "not measured"
    # a random split that diverged on seed 3 is judged on the other four, and says so
    split_seeds = stats["dirichlet-0.1"]["fedfac"]["per_seed"]
    diverging = {("dirichlet-0.1", "fedfac", same_size): {
        "seeds": 4, "per_seed": {s: f for s, f in split_seeds.items() if s != 3},
        "diverged_seeds": [3]}}
    record = {c["claim"]: c for c in claims(stats, diverging)}[split.format("fedfac")]
    assert (record["verdict"], len(record["paired_diffs"])) == ("held", 4)
    assert claim_line(record).endswith("; the reference diverged on seed 3: not paired)")
    # on every seed: nothing to pair, and the line says why
    diverging[("dirichlet-0.1", "fedfac", same_size)].update(
        per_seed={}, diverged_seeds=list(protocol.REPORT_SEEDS))
    record = {c["claim"]: c for c in claims(stats, diverging)}[split.format("fedfac")]
    assert record["verdict"] == "not measured"
    assert "(rows missing or incomplete; the reference diverged on seeds 1, 2" in claim_line(
        record)
    # the best baseline needs every baseline's row; then it is FedRep, the highest mean
    best_baseline = "feddecomp not below the best baseline by more than 1 point on dirichlet-0.1"
    assert judged[best_baseline]["verdict"] == "not measured"
    for label in ("fedprox", "local", "fedbn", "fedavg-ft"):
        stats["dirichlet-0.1"][label] = _row(base)
    judged = {c["claim"]: c for c in claims(stats, ablated)}
    assert judged["feddecomp not below the best baseline by more than 1 point on "
                  "dirichlet-0.1"]["reference"] == "fedrep"
    permuted = ("Factorized-FL >= Local - 1 point on permuted-labels at <= 1/20 of FedAvg's "
                "uplink")
    assert judged[permuted]["verdict"] == "held"
    assert judged[permuted]["uplink_share_of_fedavg"] == 0.04
    # a FedAvg whose rounds the convergence rule doubled twice sends 4 times as much in all,
    # not a round: the share is per round
    stats["permuted-labels"]["fedavg"] = _row(base, mb_up=40.0, num_rounds=160)
    judged = {c["claim"]: c for c in claims(stats, ablated)}
    assert judged[permuted]["uplink_share_of_fedavg"] == 0.04
    stats["permuted-labels"]["factorized-fl"] = _row(shifted([0.0] * 5), mb_up=0.6)
    judged = {c["claim"]: c for c in claims(stats, ablated)}
    assert judged[permuted]["verdict"] == "did not hold"  # 6% of FedAvg's a round
    # a FedAvg that diverged on a report seed has no uplink figure on it: not measured,
    # named, and no extra seeds asked for
    stats["permuted-labels"]["fedavg"] = {**_row(base[:4], mb_up=40.0), "diverged_seeds": [5]}
    record = {c["claim"]: c for c in claims(stats, ablated)}[permuted]
    assert (record["verdict"], record["diverged"]) == ("not measured", {"fedavg": [5]})
    assert "(rows missing or incomplete; fedavg diverged on seed 5)" in claim_line(record)
    stats["permuted-labels"]["fedavg"] = _row(base, mb_up=40.0, num_rounds=160)
    stats["permuted-labels"]["factorized-fl"] = _row(shifted([0.0] * 5), mb_up=0.4)
    judged = {c["claim"]: c for c in claims(stats, ablated)}
    assert judged[permuted]["diverged"] == {}
    # not worse by more than a point, but not better either: the paper's gain (+4 points)
    # lies outside the interval, so it did not reproduce
    assert judged[permuted]["superiority"] == "did not hold"
    assert judged[permuted]["paper_effect"] == pytest.approx(0.04)
    assert judged[permuted]["paper_effect_excluded"] is True
    assert decomp["superiority"] == "held" and decomp["paper_effect"] is None
    assert decomp["paper_effect_excluded"] is False
    # a paper number not found says why, never that the paper has none
    assert ("no paper number: FedDecomp's tables (arXiv 2406.19931) were not reachable "
            "here") in claim_line(decomp)
    # FedFac's interval (about -1.5 to +13.9 points) holds its paper's +2.7: not excluded
    assert fedfac["paper_effect"] == pytest.approx(0.0274)
    assert fedfac["paper_effect_excluded"] is False and fedfac["superiority"] == "did not hold"
    line = claim_line(judged[permuted])
    assert "better at all: did not hold" in line and "paper +4.0" in line
    assert "**not reproduced**: the interval lies below it (worse here)" in line
    # a paper's gain below the whole interval (FedDecomp's, about +5.8 to +6.2 points)
    assert decomp["ci95"][0] > 0.027
    above = {**decomp, "paper_effect": 0.027, "paper_source": "a table",
             "paper_effect_excluded": True}
    assert ("paper +2.7 (a table): better here than the paper reports: the interval lies "
            "above it") in claim_line(above)
    assert "within the interval" in claim_line(fedfac)
    stats["permuted-labels"]["factorized-fl"]["mb_up"] = (0.6, 0.0)  # 6% of FedAvg's
    assert {c["claim"]: c for c in claims(stats)}[permuted]["verdict"] == "did not hold"
    # a reference with 4 report seeds of 5, or a row not tuned, gives no verdict
    assert judged["pFedC not below FedRep by more than 1 point on pathological-2"][
        "verdict"] == "not measured"
    assert judged["pFedC >= FedAvg + 5 points on pathological-2"]["verdict"] == "held"
    stats["pathological-2"]["pfedc"]["tuned"] = False
    assert {c["claim"]: c for c in claims(stats)}[
        "pFedC >= FedAvg + 5 points on pathological-2"]["verdict"] == "not measured"


def test_a_reference_is_chosen_on_validation_never_on_the_report_seeds():
    """The strongest of several references is the one with the best figure on validation at
    the scenario's rounds: FedRep's report seeds are far above FedPer's, but FedPer was the
    better on validation, so the claim is judged against FedPer. A candidate whose tuning run
    at the rounds diverged (no validation figure) cannot be chosen; a candidate not chosen
    that lost a report seed does not keep the claim from being measured. No claim asks for
    more seeds."""
    base = [0.60, 0.62, 0.58, 0.61, 0.59]
    stats = {"dirichlet-0.1": {"fedavg": _row(base), "fedper": _row(base, validation=0.9),
                               "fedrep": _row([b + 0.2 for b in base], validation=0.8),
                               "feddecomp": _row([b + 0.001 for b in base])}}
    claim = "FedDecomp not below the best of FedPer/FedRep by more than 1 point"
    judged = {c["claim"]: c for c in claims(stats)}[claim]
    assert judged["reference"] == "fedper" and judged["verdict"] == "held"
    # a seed of the reference that collapsed stays in the pair, and the line names it
    stats["dirichlet-0.1"]["fedper"]["unstable_seeds"] = [2]
    judged = {c["claim"]: c for c in claims(stats)}[claim]
    assert judged["unstable"] == {"fedper": [2]} and len(judged["paired_diffs"]) == 5
    assert "; fedper unstable on seed 2 (kept in the pair)" in claim_line(judged)
    fedrep = stats["dirichlet-0.1"]["fedrep"]
    stats["dirichlet-0.1"]["fedrep"] = {**fedrep, "diverged_seeds": [3], "per_seed": {
        seed: f for seed, f in fedrep["per_seed"].items() if seed != 3}}
    assert {c["claim"]: c for c in claims(stats)}[claim]["reference"] == "fedper"
    stats["dirichlet-0.1"]["fedrep"] = fedrep
    stats["dirichlet-0.1"]["fedper"]["validation"] = None
    judged = {c["claim"]: c for c in claims(stats)}[claim]
    assert (judged["reference"], judged["verdict"]) == ("fedrep", "did not hold")
    assert "; fedper not a candidate: its tuning run diverged at the rounds" in claim_line(judged)
    del stats["dirichlet-0.1"]["fedrep"]  # a candidate that has not reported: not yet
    judged = {c["claim"]: c for c in claims(stats)}[claim]
    assert (judged["reference"], judged["verdict"]) == (None, "not measured")


def test_a_claim_names_its_row_or_reference_that_had_not_converged():
    base = [0.60, 0.62, 0.58, 0.61, 0.59]
    rising = [0.004, 0.003, 0.005, 0.004, 0.003]  # 0.4 points a round at the last round
    stats = {"dirichlet-0.1": {"fedavg": _row(base, slopes=rising),
                               "feddecomp": _row([b + 0.06 for b in base])}}
    claim = "FedDecomp >= FedAvg + 5 points on Dirichlet 0.1"
    judged = {c["claim"]: c for c in claims(stats)}[claim]
    assert judged["verdict"] == "held" and judged["not_converged"] == ["fedavg"]
    assert claim_line(judged).endswith("; ⚑ not converged: fedavg (below))")
    stats["dirichlet-0.1"]["fedavg"] = _row(base)
    judged = {c["claim"]: c for c in claims(stats)}[claim]
    assert judged["not_converged"] == [] and "⚑" not in claim_line(judged)
    stats["dirichlet-0.1"]["feddecomp"] = _row([b + 0.06 for b in base], slopes=rising)
    assert {c["claim"]: c for c in claims(stats)}[claim]["not_converged"] == ["feddecomp"]


def test_a_task_accuracy_claim_is_judged_against_the_best_reference_on_task_accuracy():
    base = [0.60, 0.62, 0.58, 0.61, 0.59]
    up = [b + 0.05 for b in base]
    stats = {"dirichlet-0.1": {label: _row(base) for label in protocol.BASELINES}}
    stats["dirichlet-0.1"]["fedavg-ft"] = _row(up)  # the best on per-client accuracy
    stats["dirichlet-0.1"]["fedbn"] = _row(base, task=up)  # the best on task accuracy
    stats["dirichlet-0.1"]["pfedc"] = _row(base, task=[b + 0.08 for b in base])
    judged = {c["claim"]: c for c in claims(stats)}
    claim = "pfedc not below the best baseline by more than 1 point on dirichlet-0.1"
    assert judged[claim]["reference"] == "fedavg-ft"
    assert judged[claim + " (task accuracy)"]["reference"] == "fedbn"
    assert judged[claim + " (task accuracy)"]["mean_diff"] == pytest.approx(0.03)


def test_an_ablation_is_reported_as_its_paired_difference_with_an_interval():
    """As a claim is judged: per seed against its row, on the seeds both have."""
    row = _row([0.60, 0.62, 0.58, 0.61, 0.59]) | {"config": "lr=0.02"}
    gains = [0.060, 0.063, 0.057, 0.061, 0.059]
    probe = protocol.Ablation("dirichlet-0.1", "feddecomp", {"feddecomp.rank": 1.0}, "why?")

    def table(per_seed: list[float], seeds: list[int]) -> str:
        ablation = {seed: {"accuracy": a} for seed, a in zip(seeds, per_seed, strict=True)}
        return ablation_table({("dirichlet-0.1", "feddecomp", "feddecomp.rank=1.0"): {
            "ablation": probe, "row": row, "seeds": len(seeds), "diverged_seeds": [],
            "per_seed": ablation,
            "accuracy": (statistics.fmean(per_seed), 0.0), "accuracy_min": (0.5, 0.0)}}, [])

    shifted = [a["accuracy"] + g for a, g in zip(row["per_seed"].values(), gains, strict=True)]
    last = table(shifted, [1, 2, 3, 4, 5]).splitlines()[-1]
    mean, low, high = map(float, re.search(r"\| ([+-][\d.]+) \[([+-][\d.]+), ([+-][\d.]+)\] \|$",
                                           last).groups())
    assert mean == 6.0 and 5.0 < low < mean < high < 7.0  # +6 give or take 0.3 on each seed
    # an ablation run on seeds 2 and 4 only is paired with the row's seeds 2 and 4 (+6.2),
    # not with the row's mean over all five (+7.7)
    assert table([shifted[1], shifted[3]], [2, 4]).splitlines()[-1].endswith(
        "| +6.2 [+4.9, +7.5] |")
    # one common seed: the difference alone
    assert table([0.70], [5]).splitlines()[-1].endswith("| +11.0 |")
    # one whose change the row's configuration already has is listed, not run
    assert ablation_table({}, [probe]).splitlines()[-1] == (
        "| dirichlet-0.1/feddecomp | feddecomp.rank=1.0 | why? | - | not run: the row's tuned "
        "configuration already has this change |  |  |  |")




@pytest.mark.parametrize(("ci95", "verdict", "superiority", "interval"), [
    ((-0.0005, 0.02), "held", "did not hold", "above the margin"),  # 0 inside: not better
    ((0.0001, 0.02), "held", "held", "above the margin"),
    ((-0.03, -0.0095), "did not hold", "did not hold", "across the margin"),  # just over it
    ((-0.03, -0.0105), "did not hold", "did not hold", "below the margin"),
    ((-0.01, 0.0), "held", "did not hold", "above the margin"),  # at the margin: held
    ((0.0, 0.02), "held", "did not hold", "above the margin"),  # 0 at the lower end
    ((-0.03, -0.01), "did not hold", "did not hold", "across the margin"),  # up to it
])
def test_a_difference_is_judged_on_where_its_interval_lies(ci95, verdict, superiority,
                                                            interval):
    """Margin -0.01 (non-inferiority within a point): held when the interval's lower end is
    at or above it; better at all (superiority) only when the lower end is above 0; below
    the margin only when the upper end is under it."""
    judged = judge_difference({"ci95": ci95}, -0.01)
    assert (judged["verdict"], judged["superiority"], judged["interval"]) == \
        (verdict, superiority, interval)


def _sloped_row(slopes: list[float]) -> dict:
    return {"per_seed": {seed: {"slope": s} for seed, s in zip(protocol.REPORT_SEEDS, slopes,
                                                                strict=False)},
            "num_rounds": 40, "slope": (statistics.fmean(slopes), 0.0), "diverged_seeds": []}


def test_a_row_has_converged_when_the_upper_end_of_its_slope_interval_is_within_the_rule():
    """0.1 points a round (a margin per 10 rounds) bounds the interval's upper end, not its
    mean or its lower end: a mean of 0.05 points spread over seeds is not converged."""
    assert CONVERGED_SLOPE == 0.001
    flat = [0.0009, 0.0008, 0.0009, 0.0008, 0.0009]  # upper end about 0.00095
    spread = [0.004, -0.003, 0.003, -0.002, 0.0005]  # mean 0.0005, upper end about 0.0043
    assert converged(flat) and not converged(spread)
    assert not converged([0.0])  # one seed: no interval, no judgement
    assert flag(_sloped_row(flat)) == ""
    assert flag(_sloped_row(spread)).startswith(
        "not converged at round 40: slope over the last 10 rounds +0.05 points a round, 95% "
        "interval [-0.33, +0.43]")
    assert flag(_sloped_row([0.0])) == "one seed: convergence cannot be judged"
    # informative only: the rounds were fixed on validation before the report seeds ran
    assert flag(_sloped_row(spread)).endswith(
        "the scenario's rounds were fixed on validation before any report seed ran, at most 2 "
        "doublings)")
