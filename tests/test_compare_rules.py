"""compare's two rules shared with the evidence matrix (comparison/stats.py ``unstable``,
comparison/multiplicity.py ``holm``), on a federation whose runs' curves are scripted: a row
with a report seed that collapsed or diverged names it, is shown without it and is never
called not worse; the ``--primary`` rows are judged together with Holm's correction, the
others are exploratory."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from scipy import stats

from comparison.multiplicity import holm
from launch.compare import main
from tests.scripted_federation import ScriptedFederation


def _compare(tmp_path: Path, script, methods: str, seeds: str, *more: str
             ) -> tuple[int, dict, str, ScriptedFederation]:
    federation = ScriptedFederation(script)
    out = tmp_path / "out"
    code = main(["--methods", methods, "--seeds", seeds, "--supernodes", "2", "--out",
                 str(out), *more, "num-server-rounds=10"], federation=federation)
    return (code, json.loads((out / "summary.json").read_text()),
            (out / "report.md").read_text(), federation)


def _line(report: str, label: str) -> str:
    return next(line for line in report.splitlines() if line.startswith(f"| {label} |"))


def _rules_script(run_config: dict) -> list[float] | str:
    """fedavg (the reference) is low on seed 2; fedprox and fedper are steadily half a point
    above it, but fedprox's seed 2 collapses there from 95 (its figure, 40.5, under half its
    best 5 rounds); local diverges on seed 3."""
    method, seed = run_config["method"], run_config["seed"]
    base = 0.40 if seed == 2 else 0.70 + 0.001 * seed
    if method == "fedavg":
        return [base] * 10
    if method == "local" and seed == 3:
        return "diverged"
    above = base + 0.005 + 0.0005 * seed
    if method == "fedprox" and seed == 2:
        return [0.95] * 5 + [above] * 5
    return [above] * 10


def test_a_row_with_an_unstable_seed_names_it_shows_its_mean_without_it_and_is_not_called(
        tmp_path):
    code, summary, report, federation = _compare(
        tmp_path, _rules_script, "fedavg,fedprox,fedper,local", "1,2,3")
    rows = summary["rows"]
    fedprox, fedper, local = rows["fedprox"], rows["fedper"], rows["local"]
    # collapsed: named, counted, its figure kept in the row's mean and pairs (as the matrix)
    assert fedprox["unstable_seeds"] == [2] and fedprox["diverged_seeds"] == []
    assert fedprox["unstable_why"] == {
        "2": "collapsed: 40.6 over its last rounds against a best of 95.0"}
    figures = {s: f["accuracy"] for s, f in fedprox["per_seed"].items()}
    assert fedprox["accuracy"][0] == pytest.approx(statistics.fmean(figures.values()))
    without = [figures["1"], figures["3"]]
    assert fedprox["accuracy_stable"] == pytest.approx(
        [statistics.fmean(without), statistics.stdev(without)])
    # its interval lies above the margin and above 0, as fedper's: fedper is called not worse
    # and better, fedprox neither, in summary.json and in the report
    assert fedprox["versus_reference"]["ci95"][0] > 0
    assert fedper["verdicts"]["verdict"] == fedper["verdicts"]["superiority"] == "held"
    assert fedprox["verdicts"]["verdict"] == fedprox["verdicts"]["superiority"] == \
        "held, but unstable"
    assert fedprox["verdict_adjusted"] == "held, but unstable"
    line = _line(report, "fedprox")
    assert (f"| 3, collapsed on seed 2 | {100 * fedprox['accuracy'][0]:.1f} ± "
            f"{100 * fedprox['accuracy'][1]:.1f} | {100 * statistics.fmean(without):.1f} ± "
            f"{100 * statistics.stdev(without):.1f} |") in line
    # not worse, better, and Holm-adjusted
    assert line.endswith("| held, but unstable: seed 2 collapsed | held, but unstable: seed 2 "
                         "collapsed | [+0.4, +0.8] held, but unstable: seed 2 collapsed |")
    fedper_line = _line(report, "fedper")
    assert "| 3 | " in fedper_line and "| held | held |" in fedper_line
    assert "| - |" in fedper_line  # nothing to leave out
    # diverged: stored as a result (no figure), named, not a failure; not run again
    assert local["seeds"] == ["1", "2"] and local["diverged_seeds"] == [3]
    assert local["unstable_seeds"] == [3] and local["unstable_why"] == {"3": "diverged"}
    assert local["verdicts"]["verdict"] == "held, but unstable"
    assert "| 2, diverged on seed 3 |" in _line(report, "local")
    assert "held, but unstable: seed 3 diverged" in _line(report, "local")
    assert code == 0 and summary["failed"] == []
    record = json.loads((tmp_path / "out" / "runs" / "local" / "report-defaults-seed3.json")
                        .read_text())
    assert record["status"] == "diverged" and "not finite" in record["reason"]
    assert "Unstable seed: a report seed that diverged, or collapsed" in report
    assert len(federation.runs) == 12
    again = ScriptedFederation(_rules_script)
    assert main(["--methods", "fedavg,fedprox,fedper,local", "--seeds", "1,2,3",
                 "--supernodes", "2", "--out", str(tmp_path / "out"),
                 "num-server-rounds=10"], federation=again) == 0
    assert again.runs == []


# five seeds' paired differences against fedavg with a chosen one-sided p-value against the
# margin (-1 point): their mean is the margin plus t standard errors, their spread fixed
SHIFT = [0.002, -0.002, 0.001, -0.001, 0.0]
P_VALUES = {"fedprox": 0.001, "fedper": 0.014, "fedbn": 0.02, "local": 0.02}


def _at_p(p: float) -> list[float]:
    se = statistics.stdev(SHIFT) / math.sqrt(len(SHIFT))
    return [-0.01 + stats.t.isf(p, len(SHIFT) - 1) * se + s for s in SHIFT]


def _holm_script(run_config: dict) -> list[float]:
    method, seed = run_config["method"], run_config["seed"]
    return [0.7 + (_at_p(P_VALUES[method])[seed - 1] if method in P_VALUES else 0.0)] * 10


def test_the_primary_rows_are_judged_with_holms_step_down_and_the_others_are_exploratory(
        tmp_path):
    """Unadjusted, all four rows are not worse (p at most 2.5%). Holm over the three primary
    ones: fedprox (p 0.1%) holds at 2.5%/3, fedper (1.4%) fails at 2.5%/2, so fedbn (2%) is
    not judged further and fails too; local, exploratory, keeps its unadjusted verdict."""
    code, summary, report, _ = _compare(tmp_path, _holm_script,
                                        "fedavg,fedprox,fedper,fedbn,local", "1,2,3,4,5",
                                        "--primary", "fedprox,fedper,fedbn")
    assert code == 0 and summary["protocol"]["primary"] == ["fedprox", "fedper", "fedbn"]
    rows = summary["rows"]
    assert {label: rows[label]["verdicts"]["verdict"] for label in P_VALUES} == \
        dict.fromkeys(P_VALUES, "held")
    assert {label: row["primary"] for label, row in rows.items()} == {
        "fedavg": False, "fedprox": True, "fedper": True, "fedbn": True, "local": False}
    assert [rows[label]["p_value"] for label in ("fedprox", "fedper", "fedbn")] == \
        pytest.approx([0.001, 0.014, 0.02], rel=1e-3)
    assert [rows[label]["verdict_adjusted"] for label in ("fedprox", "fedper", "fedbn")] == \
        ["held", "did not hold", "did not hold"]
    assert "ci95_adjusted" not in rows["local"] and "verdict_adjusted" not in rows["local"]
    for label in ("fedprox", "fedper", "fedbn"):
        low, high = rows[label]["ci95_adjusted"]
        ci95 = rows[label]["versus_reference"]["ci95"]
        assert low <= ci95[0] and high >= ci95[1]  # no narrower than the unadjusted one
        line = _line(report, label)
        assert f"| held | did not hold | [{100 * low:+.1f}, {100 * high:+.1f}] " \
            f"{rows[label]['verdict_adjusted']} |" in line
    assert _line(report, "local").endswith("| held | did not hold | exploratory |")
    assert ("The primary family (`--primary`): fedprox, fedper, fedbn, judged together with "
            "Holm's step-down correction") in report
    # by default every row but the reference is primary: local joins the family (m = 4)
    _, default, _, _ = _compare(tmp_path / "default", _holm_script,
                                "fedavg,fedprox,fedper,fedbn,local", "1,2,3,4,5")
    assert default["protocol"]["primary"] == ["fedprox", "fedper", "fedbn", "local"]
    assert default["rows"]["fedprox"]["holm_level"] == pytest.approx(0.025 / 4)


def test_holm_counts_a_claim_that_cannot_hold_in_its_family():
    """The matrix's uplink bound is such a condition (``cannot_hold``): judged at p = 1."""
    records = [{"primary": True, "verdict": "held", "margin": -0.01,
                "paired_diffs": _at_p(0.001)} for _ in range(2)]
    holm(records, cannot_hold=lambda record: record is records[0])
    assert [r["verdict_adjusted"] for r in records] == ["did not hold", "held"]
    assert records[0]["holm_family"] == 2 and records[1]["holm_level"] == 0.025 / 2


@pytest.mark.parametrize("primary", ["nosuchrow", "fedprox,fedavg"])
def test_primary_names_rows_compared_with_the_reference_or_exits_2_with_one_line(
        tmp_path, capsys, primary):
    federation = ScriptedFederation(_holm_script)
    assert main(["--methods", "fedavg,fedprox", "--primary", primary, "--supernodes", "2",
                 "--out", str(tmp_path / "out"), "num-server-rounds=10"],
                federation=federation) == 2
    error = capsys.readouterr().err
    wrong = primary.split(",")[-1]
    assert error.startswith(f"compare: --primary: {wrong!r} is not a row compared with the "
                            "reference fedavg (fedavg, fedprox)")
    assert error.count("\n") == 1 and federation.runs == []
