"""The statistics a comparison's figures come from (comparison/stats.py, shared with the
evidence matrix) and the report that states them (comparison/report.py): the window a run is
read on, paired differences, the convergence mark, units and clients in the report."""

from __future__ import annotations

import pytest

from comparison.report import report_markdown, run_text
from comparison.stats import (
    choose,
    figure_rounds,
    full_window_rounds,
    last_rounds_mean,
    method_stats,
    paired_difference,
    run_figures,
    slope,
)


def _report_row(slopes: list[float]) -> dict:
    """A compare row whose seeds' curves rise by these amounts a round over 20 rounds."""
    runs = {str(seed): {"accuracy_per_round": [0.5 + rise * r for r in range(20)],
                        "accuracy_min": 0.4, "mb_up_total": 1.0, "seconds_total": 1.0}
            for seed, rise in enumerate(slopes, 1)}
    return {"method": "fedavg", "grid": [{}], "chosen": {}, "tuning": [],
            "curves": {s: r["accuracy_per_round"] for s, r in runs.items()},
            "rounds": {s: list(range(1, 21)) for s in runs}, **method_stats(runs)}


def test_compare_marks_a_row_not_converged_by_the_matrix_rule():
    """compare and the evidence matrix share one rule (``comparison.stats.converged``): the
    upper end of the 95% interval of the mean slope over seeds at most 0.1 points a round. A
    small mean slope spread over seeds is not converged; a steady one is; one seed is not
    judged."""
    rows = {"steady": _report_row([0.0005, 0.0006, 0.0004]),
            "spread": _report_row([0.004, -0.003, 0.0005]),
            "single": _report_row([0.0])}
    assert [r["converged"] for r in rows.values()] == [True, False, False]
    assert rows["spread"]["slope"][0] == pytest.approx(0.0005)
    summary = {"protocol": {"seeds": [1, 2, 3], "tuning_seed": 0, "selection": "validation",
                            "validation_fraction": 0.2, "budgets": dict.fromkeys(rows, 1),
                            "reference": "steady", "margin": -0.01},
               "rows": rows, "failed": []}
    lines = {line.split(" | ")[0][2:]: line for line in report_markdown(summary, "compare")
             .splitlines() if line.startswith("| ") and " | " in line}
    assert "+0.05 |" in lines["steady"]
    assert "+0.05 (not converged) |" in lines["spread"]
    assert "+0.00 (one seed: not judged) |" in lines["single"]


def test_paired_difference_gives_the_mean_and_the_t_interval_of_the_per_seed_differences():
    method = {1: 0.70, 2: 0.80, 3: 0.90, 4: 0.5}
    reference = {1: 0.69, 2: 0.78, 3: 0.87, 5: 0.1}  # seeds 4 and 5 are not paired
    result = paired_difference(method, reference)
    assert result["seeds"] == [1, 2, 3]
    assert result["paired_diffs"] == pytest.approx([0.01, 0.02, 0.03])
    assert result["mean_diff"] == pytest.approx(0.02)
    # sd 0.01 over 3 seeds, t(0.975, 2) = 4.303 (tables): half width 0.02484
    assert result["ci95"] == pytest.approx((0.02 - 0.02484, 0.02 + 0.02484), abs=1e-5)
    assert paired_difference({1: 0.5}, {1: 0.4})["ci95"] is None
    assert paired_difference({1: 0.5}, {2: 0.4}) is None


def test_last_rounds_mean_and_slope_read_the_end_of_the_curve():
    curve = [0.1, 0.2, 0.5, 0.6, 0.6, 0.7, 0.7]
    assert last_rounds_mean(curve) == pytest.approx(0.62)  # the last 5
    assert last_rounds_mean([0.3, 0.5]) == pytest.approx(0.5)  # round 1 is its first quarter
    assert slope([0.5 + 0.01 * r for r in range(20)]) == pytest.approx(0.01)
    assert slope([0.9] * 12 + [0.1, 0.2]) < 0  # only the last 10 count
    assert slope([0.4]) == 0.0
    # least squares, not the end points' difference ((1 - 0) / 9): 4.5 / 82.5
    assert slope([0.0] * 9 + [1.0]) == pytest.approx(3 / 55)


def test_a_runs_figure_never_reads_the_first_quarter_of_its_rounds():
    """A run's window (compare's and the evidence matrix's): the last 5 evaluated rounds,
    none that starts in the first quarter of the run (rounds 1 to ceil(n/4)); shorter runs
    are read on fewer rounds, a run of one round on it."""
    windows = {n: figure_rounds(range(1, n + 1))
               for n in (1, 2, 3, 4, 5, 6, 7, 8, 10, 30)}
    assert windows == {1: [1], 2: [2], 3: [2, 3], 4: [2, 3, 4], 5: [3, 4, 5],
                       6: [3, 4, 5, 6], 7: [3, 4, 5, 6, 7], 8: [4, 5, 6, 7, 8],
                       10: [6, 7, 8, 9, 10], 30: [26, 27, 28, 29, 30]}
    assert full_window_rounds() == 7
    assert all(figure_rounds(range(1, n + 1)) == list(range(n - 4, n + 1))
               for n in range(7, 40))  # the plain last 5 from 7 rounds on
    # rounds evaluated thinly (evaluate-every) or missing (every evaluation dropped): the
    # quarter is of the run's rounds, not of the evaluated ones
    assert figure_rounds([1, 2, 4, 5]) == [4, 5]
    assert figure_rounds([10, 20, *range(26, 36)]) == [31, 32, 33, 34, 35]
    curve = [0.0, 0.1, 0.3, 0.4, 0.5]
    assert last_rounds_mean(curve) == pytest.approx(0.4)
    assert last_rounds_mean([0.0, 0.1, 0.4, 0.5], rounds=[1, 2, 4, 5]) == pytest.approx(0.45)
    run = {"accuracy_per_round": curve, "accuracy_min_per_round": [0.0, 0.0, 0.1, 0.2, 0.3],
           "accuracy_min": 0.3, "rounds": [1, 2, 3, 4, 5], "mb_up_total": 1.0,
           "seconds_total": 1.0, "evaluated_on": "validation"}
    figures = run_figures(run)
    assert (figures["accuracy"], figures["accuracy_min"]) == pytest.approx((0.4, 0.2))
    # a configuration is chosen on the same rounds: b's first rounds are higher, its
    # window is not
    rising = {**run, "accuracy_per_round": [0.9, 0.9, 0.3, 0.3, 0.3]}
    assert choose([("a", run), ("b", rising)]) == "a"


def _five_round_run(seed: int, rounds: int = 5) -> dict:
    """A run whose first round is far off its last ones (a run's figure must not read it)."""
    curve = [0.05] + [0.2 + 0.01 * seed + 0.001 * r for r in range(2, rounds + 1)]
    return {"accuracy_per_round": curve, "accuracy_min_per_round": [c - 0.1 for c in curve],
            "accuracy_min": curve[-1] - 0.1, "rounds": list(range(1, rounds + 1)),
            "mb_up_total": 2.0, "seconds_total": 3.0, "evaluated_on": "test"}


def _summary(rows: dict[str, dict[str, dict]], clients: int | None = 10) -> dict:
    """A compare summary of these rows (label -> seed -> run), as ``launch.compare`` makes
    it."""
    summary_rows = {
        label: {"method": label, "grid": [{}], "chosen": {}, "tuning": [],
                "curves": {s: r["accuracy_per_round"] for s, r in runs.items()},
                "rounds": {s: r["rounds"] for s, r in runs.items()},
                **method_stats(runs)}
        for label, runs in rows.items()}
    protocol = {"seeds": [1, 2, 3], "tuning_seed": 0, "selection": "validation",
                "validation_fraction": 0.2, "budgets": dict.fromkeys(rows, 1),
                "reference": next(iter(rows)), "margin": -0.01,
                **({"clients": clients} if clients else {})}
    return {"protocol": protocol, "rows": summary_rows, "failed": []}


def test_the_report_states_its_window_units_and_clients_and_warns_of_short_runs():
    """A comparison of 5-round runs: the report says which rounds each figure is the mean
    of (3-5, never round 1), warns once that the runs are short, writes points under
    headers that say so, and names the number of clients; a run's printed line gives the
    figure the report's row is the mean of."""
    runs = {str(seed): _five_round_run(seed) for seed in (1, 2, 3)}
    summary = _summary({"fedavg": runs})
    report = report_markdown(summary, "compare")
    assert "10 clients (`--supernodes`: the data is split into 10 partitions" in report
    assert "mean of rounds 3-5 (a run's last 5 evaluated rounds, none in the first quarter" \
        in report
    assert report.count("**Short runs**: a run of 5 rounds is read on rounds 3-5 (3 of its "
                        "5)") == 1
    assert "run 7 rounds or more for all 5" in report
    header = next(line for line in report.splitlines() if line.startswith("| row |"))
    assert ("| accuracy (points, mean ± std) | without unstable seeds | min client (points) | "
            "slope (points/round) |" in header)
    assert "| vs fedavg (points, 95% interval) |" in header
    per_seed = [(0.2 + 0.01 * s + 0.004) for s in (1, 2, 3)]  # rounds 3-5: 0.003..0.005
    fedavg = summary["rows"]["fedavg"]
    assert [fedavg["per_seed"][str(s)]["accuracy"] for s in (1, 2, 3)] == \
        pytest.approx(per_seed)
    row = next(line for line in report.splitlines() if line.startswith("| fedavg |"))
    assert f"| {100 * sum(per_seed) / 3:.1f} ± 1.0 | - | {100 * sum(per_seed) / 3 - 10:.1f} |" \
        in row
    # the run's line: the same figure, the same rounds, the same unit
    assert run_text(runs["2"]) == (f"accuracy {100 * per_seed[1]:.1f}, min client "
                                   f"{100 * per_seed[1] - 10:.1f} (points, mean of rounds 3-5)")
    # long enough runs: the last 5, no warning; rows of other lengths each say theirs
    long = report_markdown(_summary({"fedavg": {"1": _five_round_run(1, rounds=10)}}), "c")
    assert "mean of rounds 6-10 (" in long and "Short runs" not in long
    mixed = report_markdown(_summary({"fedavg": {"1": _five_round_run(1, rounds=10)},
                                      "local": {"1": _five_round_run(1, rounds=2)}}), "c")
    assert "mean of rounds 6-10 (fedavg), round 2 (local) (" in mixed
    assert "**Short runs**: a run of 2 rounds is read on round 2 (1 of its 2):" in mixed
    # a summary written before the number of clients was recorded names none
    assert "clients (`--supernodes`" not in report_markdown(_summary({"fedavg": runs}, None),
                                                            "c")


_SUMMARY = {"accuracy_per_round": [0.5] * 6,
            "accuracy_min_per_round": [0.0, 0.1, 0.2, 0.2, 0.3, 0.7], "accuracy_min": 0.7,
            "mb_up_total": 1.0, "seconds_total": 1.0, "evaluated_on": "validation"}
_BEFORE_MIN_CURVE = {k: v for k, v in _SUMMARY.items() if k != "accuracy_min_per_round"}


def test_a_runs_lowest_client_figure_is_the_last_rounds_mean_of_its_curve():
    """The lowest client's figure reads the end of its curve as accuracy does; a summary
    stored before that curve was kept gives its final value."""
    # rounds 3-6 of 6 (rounds 1-2 are its first quarter): (0.2 + 0.2 + 0.3 + 0.7) / 4
    assert run_figures(_SUMMARY)["accuracy_min"] == pytest.approx(0.35)
    assert run_figures(_BEFORE_MIN_CURVE)["accuracy_min"] == 0.7


def test_between_equal_validation_figures_the_search_keeps_the_first_configuration():
    """So that choosing again from the same cells chooses the same."""
    tried = [("first", _SUMMARY), ("second", dict(_SUMMARY)), ("third", _BEFORE_MIN_CURVE)]
    assert choose(tried) == "first"
