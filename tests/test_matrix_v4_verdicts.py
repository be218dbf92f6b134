"""Protocol v4's verdicts (bench/evidence/stats.py, pick.py, claims.py, multiplicity.py,
mechanism.py, protocol.py): one rule for unstable seeds, a pick a user can read, primary
claims corrected with Holm's procedure, each paper method's mechanism in every searched
configuration, the same local epochs for every row."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from scipy import stats

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.claims import CLAIMS, PRIMARY, claim_line
from bench.evidence.mechanism import mechanism_off
from bench.evidence.multiplicity import holm
from bench.evidence.pick import README_LINE_CHARS, pick_lines, picks, readme_lines
from bench.evidence.protocol import SCENARIOS
from bench.evidence.stats import row_stats
from comparison.multiplicity import interval, p_value
from comparison.stats import collapsed, judge_difference, mean_interval, unstable
from tests.test_matrix import COMMON_DIGITS, _store, _tuned_fedavg, only_rows

SCENARIO = "dirichlet-0.1"


def test_a_seed_that_collapsed_or_diverged_is_unstable_the_same_way_for_every_row(
        tmp_path, monkeypatch):
    """Its last-5 mean below half its best 5-round mean (79.2 to 36.5): named, its row's mean
    shown with and without it; a curve that stays low, or dips and comes back, is not."""
    fall = {"accuracy_per_round": [0.792] * 30 + [0.365] * 10, "rounds": list(range(1, 41))}
    assert collapsed(fall) == "collapsed: 36.5 over its last rounds against a best of 79.2"
    assert collapsed({"accuracy_per_round": [0.1] * 40}) == ""
    assert collapsed({"accuracy_per_round": [0.8] * 20 + [0.3] * 5 + [0.8] * 15}) == ""
    assert unstable({1: fall, 2: {"status": "diverged"}, 3: {"accuracy_per_round": [0.5]}}) \
        == {1: collapsed(fall), 2: "diverged"}
    only_rows(monkeypatch, "fedavg")
    offline, item, tuned = _tuned_fedavg(tmp_path)
    for seed in protocol.REPORT_SEEDS:
        _store(offline, SCENARIO, item, tuned, [0.8] * 6 + [0.3 if seed == 4 else 0.8] * 6,
               stage="report", seed=seed)
    row = row_stats(offline, SCENARIO, item)
    assert row["unstable_seeds"] == [4] and row["seeds"] == 10
    assert row["accuracy"][0] == pytest.approx(0.75)  # with it: 9 x 0.8 and 0.3
    assert row["accuracy_stable"][0] == pytest.approx(0.8)  # without it


def _row(label: str, per_seed: list[float], unstable_seeds: tuple[int, ...] = (),
         mb_up: float = 40.0) -> dict:
    return {"label": label, "tuned": True, "num_rounds": 40, "rounds_fixed": True,
            "diverged_seeds": [], "unstable_seeds": list(unstable_seeds),
            "unstable_why": dict.fromkeys(unstable_seeds, "collapsed: ..."),
            "per_seed": {seed: {"accuracy": a, "slope": 0.0}
                         for seed, a in enumerate(per_seed, 1)},
            "accuracy": (statistics.fmean(per_seed), statistics.stdev(per_seed)),
            "slope": (0.0, 0.0), "mb_up": (mb_up, 0.0)}


def test_the_pick_runs_the_best_stable_row_and_names_what_is_within_a_point_and_what_not(
        monkeypatch):
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1, 2, 3, 4, 5))
    best = [0.80, 0.82, 0.78, 0.81, 0.79]
    stats = {SCENARIO: {
        "fedper": _row("fedper", best),
        # half a point below on every seed, give or take 0.1: within the margin
        "fedrep": _row("fedrep", [b - d for b, d in zip(best, [0.004, 0.006, 0.005, 0.005,
                                                              0.004], strict=True)], mb_up=20.0),
        # a point and a half below give or take a point: across the margin, undecided
        "fedbn": _row("fedbn", [b - d for b, d in zip(best, [0.005, 0.025, 0.015, 0.005,
                                                             0.025], strict=True)]),
        # 3 points below on every seed: below the margin
        "fedavg": _row("fedavg", [b - 0.03 for b in best]),
        # the highest mean, but a seed collapsed: never run or also
        "fedavg-ft": _row("fedavg-ft", [b + 0.05 for b in best], unstable_seeds=(3,))}}
    pick = picks(stats)[SCENARIO]
    assert pick["run"] == "fedper" and list(pick["also"]) == ["fedrep"]
    assert list(pick["undecided"]) == ["fedbn"]
    assert pick["avoid"]["fedavg-ft"] == "unstable: seed 3 (collapsed: ...)"
    assert pick["avoid"]["fedavg"].startswith("below it: -3.0 [")
    assert "local" in pick["missing"]
    line = pick_lines({SCENARIO: pick}, stats)
    assert line.startswith(f"- **{SCENARIO}** (40 rounds): run **fedper** 80.0 ± 1.6, 1.00 MB "
                           "a round; also within 1 point: fedrep -0.5 [")
    assert "0.50 MB a round; avoid: fedavg-ft (unstable: seed 3" in line
    # the README's lines: the same picks, short, one per scenario; provisional while a row
    # is missing
    readme = readme_lines({SCENARIO: pick}, stats).splitlines()
    assert readme == [f"- **{s}**: not in yet" if s != SCENARIO else
                      f"- **{SCENARIO}** (provisional, 40 rounds): run **fedper** 80.0 (1.00 MB a "
                      "round); within 1 point: fedrep (0.50 MB); avoid: fedavg-ft, fedavg"
                      for s in SCENARIOS]
    # every row in and settled: no longer provisional; too many rows for one line: the uplinks
    # within a point go, then the rows past those that fit, avoided ones first, counted
    for ties, below in ((1, 8), (12, 0), (12, 8)):
        many = {"fedper": stats[SCENARIO]["fedper"],
                **{f"method-with-a-long-name-{k}": _row(f"method-with-a-long-name-{k}",
                                                        [b - 0.001 for b in best])
                   for k in range(ties)},
                **{f"worse-method-{k}": _row(f"worse-method-{k}", [b - 0.03 for b in best])
                   for k in range(below)}}
        crowded = picks({SCENARIO: many})[SCENARIO]
        crowded["missing"] = []
        line = readme_lines({SCENARIO: crowded}, {SCENARIO: many}).splitlines()[
            list(SCENARIOS).index(SCENARIO)]
        assert len(line) <= README_LINE_CHARS, line
        head = (f"- **{SCENARIO}** (40 rounds): run **fedper** 80.0 (1.00 MB a round); within 1 "
                "point: method-with-a-long-name-0")
        assert line.startswith(head), line
        within, avoid = line.removeprefix(head[:head.index("within")]).split("; avoid: ")
        shown_within, shown_avoid = within.split(", "), avoid.split(", ")
        assert "MB" not in within
        if below:
            assert shown_avoid[-1] == f"+{below - len(shown_avoid) + 1} more", line
        if ties == 12 and below:
            assert shown_avoid == [f"+{below} more"]  # the avoided ones are cut first
        if ties == 12:
            assert shown_within[-1] == f"+{ties - len(shown_within) + 1} more", line
    # every row unstable: nothing to run, and the line says so
    for r in stats[SCENARIO].values():
        r["unstable_seeds"], r["unstable_why"] = [5], {5: "diverged"}
    pick = picks(stats)[SCENARIO]
    assert pick["run"] is None and pick["also"] == {}
    assert pick_lines({SCENARIO: pick}, stats).startswith(
        f"- **{SCENARIO}**: nothing to run: every row in so far is unstable (fedper, fedrep")
    assert readme_lines({SCENARIO: pick}, stats).splitlines()[list(SCENARIOS).index(
        SCENARIO)].startswith(f"- **{SCENARIO}** (provisional): nothing to run, every row in is "
                              "unstable; avoid: fedper, fedrep")


def _record(diffs: list[float], primary: bool = True, **more) -> dict:
    mean, ci95 = mean_interval(diffs)
    verdict = judge_difference({"ci95": ci95}, -0.01)["verdict"]
    return {"primary": primary, "paired_diffs": diffs, "margin": -0.01, "verdict": verdict,
            "mean_diff": mean, "ci95": list(ci95), **more}


def test_a_claims_p_value_and_its_interval_agree_at_every_level():
    rng = random.Random(0)
    for _ in range(200):
        diffs = [rng.gauss(rng.uniform(-0.03, 0.02), rng.uniform(0.001, 0.02))
                 for _ in range(10)]
        for alpha in (0.025, 0.0125, 0.025 / 7):
            held = interval(diffs, alpha)[0] >= -0.01
            assert held == (p_value(diffs, -0.01) <= alpha)
        assert interval(diffs, 0.025) == pytest.approx(list(mean_interval(diffs)[1]))


def test_primary_claims_are_judged_with_holms_step_down_and_the_others_left_alone():
    shift = [0.002, -0.002, 0.001, -0.001, 0.0015, -0.0015, 0.0005, -0.0005, 0.0025, -0.0025]
    se = statistics.stdev(shift) / math.sqrt(len(shift))

    def at_p(p: float) -> list[float]:
        """Paired differences whose one-sided p-value against -1 point is ``p``."""
        return [-0.01 + stats.t.isf(p, len(shift) - 1) * se + s for s in shift]

    records = [_record(at_p(1e-6)), _record(at_p(0.01)), _record(at_p(0.02)),
               _record(at_p(0.02), primary=False)]
    holm(records)
    assert [r["holm_step"] for r in records[:3]] == [1, 2, 3]
    assert [r["holm_level"] for r in records[:3]] == pytest.approx([0.025 / 3, 0.0125, 0.025])
    assert [r["p_value"] for r in records[:3]] == pytest.approx([1e-6, 0.01, 0.02])
    assert [r["verdict_adjusted"] for r in records[:3]] == ["held"] * 3
    assert "ci95_adjusted" not in records[3] and records[3]["verdict"] == "held"
    for record in records[:3]:
        low, high = record["ci95_adjusted"]
        assert low <= record["ci95"][0] and high >= record["ci95"][1]  # wider
        assert low >= -0.01  # the step's test, on its interval
    # step down: the first step fails (0.01 > 0.025 / 3), so the second does not hold either,
    # though its own p (0.01) is under its level (0.0125); held unadjusted, all three
    failing = [_record(at_p(0.01)), _record(at_p(0.011)), _record(at_p(0.5))]
    holm(failing)
    assert [r["verdict"] for r in failing] == ["held", "held", "did not hold"]
    assert [r["verdict_adjusted"] for r in failing] == ["did not hold"] * 3
    assert failing[1]["p_value"] <= failing[1]["holm_level"] == 0.0125
    # an uplink bound missed, or a claim not measured, counts in the family and cannot hold
    bound = _record([0.02 + s for s in shift], uplink_share_of_fedavg=0.06,
                    max_uplink_share=0.05)
    absent = {"primary": True, "paired_diffs": [], "margin": -0.01, "verdict": "not measured"}
    holm([bound, absent])
    assert bound["verdict_adjusted"] == "did not hold" and bound["holm_family"] == 2
    assert absent["verdict_adjusted"] == "not measured" and absent["ci95_adjusted"] is None
    line = claim_line({**bound, "claim": "c", "reference": "local", "interval": "x",
                       "figure": "accuracy", "superiority": "held", "paper_effect": None,
                       "paper_source": "", "not_converged": []})
    assert line.startswith("- (primary) c: ") and "Holm (step " in line


def test_each_paper_method_has_one_or_two_primary_claims_and_every_other_is_exploratory():
    by_method: dict[str, int] = {}
    for claim in CLAIMS:
        if claim.primary:
            method = claim.method.split("@")[0].lower()
            by_method[method] = by_method.get(method, 0) + 1
    assert set(by_method) == {"feddecomp", "fedfac", "pfedc", "factorized-fl"}
    assert all(1 <= n <= 2 for n in by_method.values())
    assert {c.claim for c in CLAIMS if c.primary} == PRIMARY
    assert sum(not c.primary for c in CLAIMS) == len(CLAIMS) - len(PRIMARY) > 0


def test_every_searched_configuration_of_a_paper_method_keeps_its_mechanism(tmp_path,
                                                                            monkeypatch):
    matrix = Matrix(None, protocol.COMMON, tmp_path, num_clients=3)
    for scenario, spec in SCENARIOS.items():
        for item in spec.entries:
            for config in (protocol.learning_rate_stage()
                           + protocol.settings_stage(item.method, 0.03)):
                resolved = matrix._resolved(scenario, item, config)
                assert mechanism_off(item.method, resolved) == [], (item.label, config)
    # and turning it off is an ablation: each found, and listed among the ablations
    item = {e.label: e for e in SCENARIOS[SCENARIO].entries}
    for label, change in (("factorized-fl", {"factorized-fl.l1": 0.0}),
                          ("factorized-fl", {"factorized-fl.variant": "uvm"}),
                          ("feddecomp", {"feddecomp.rank": 1.0}),
                          ("fedfac@dynamic", {"fedfac.tau-quantile": 2.0}),
                          ("fedfac", protocol.SAME_SIZE_RANDOM_SPLIT),
                          ("pfedc", {"pfedc.branches": "personal"})):
        resolved = matrix._resolved(SCENARIO, item[label], protocol.expand(change))
        assert mechanism_off(item[label].method, resolved), (label, change)
    changes = [a.change for a in protocol.ABLATIONS]
    assert {"factorized-fl.l1": 0.0} in changes and {"fedfac.tau-quantile": 2.0} in changes
    # a search that would try one refuses before anything runs
    monkeypatch.setitem(protocol.SETTINGS, "factorized-fl", [{"factorized-fl.l1": 0.0}])
    tuning = Matrix(None, COMMON_DIGITS, tmp_path / "t", num_clients=3)
    for lr in protocol.LR_GRID:
        _store(tuning, "permuted-labels", item["factorized-fl"], {"lr": lr},
               [0.5 if lr == 0.03 else 0.1] * 2)
    with pytest.raises(ValueError, match=r"l1 = 0.0: mu is not sparse: an ablation"):
        tuning.searched("permuted-labels", item["factorized-fl"], tune=True)


def test_every_row_of_a_scenario_computes_as_much_a_round_in_every_configuration(tmp_path):
    """The same local epochs and batch size (a method's split of its epochs, FedRep's head
    epochs or FedDecomp's B A epochs, is its own setting); no knob changes how many steps a
    round takes; every row the same number of configurations."""
    assert not any({"local-epochs", "batch-size", "num-server-rounds"} & set(knob)
                   for knob in protocol.COMMON_KNOBS)
    assert not any("local-epochs" in change for settings in protocol.SETTINGS.values()
                   for change in settings)
    matrix = Matrix(None, protocol.COMMON, tmp_path, num_clients=3)
    for scenario, spec in SCENARIOS.items():
        budget = set()
        for item in spec.entries:
            configs = protocol.learning_rate_stage() + protocol.settings_stage(item.method, 0.03)
            budget.add(len(configs))
            for config in configs:
                resolved = matrix._resolved(scenario, item, config)
                assert (resolved["local-epochs"], resolved["batch-size"]) == (5, 32), (
                    scenario, item.label, config)
        assert budget == {len(protocol.LR_GRID) + protocol.EXTRA_CONFIGS}
    assert math.prod(protocol.REPORT_SEEDS) and len(protocol.REPORT_SEEDS) == 10
