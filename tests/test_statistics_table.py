"""The statistics tables of compare, the evidence matrix and bench/run_methods.py come from one
writer (``comparison/table.py``), in one unit: the same statistics give the same cells."""

from __future__ import annotations

from bench.evidence.tables import table as matrix_table
from bench.run_methods import table as runs_table
from comparison.report import report_markdown
from tests.conftest import ROOT

# one row's statistics as comparison.stats.method_stats gives them (fractions)
STATS = {"accuracy": (0.81234, 0.01266), "accuracy_min": (0.5555, 0.02), "slope": (0.00049, 0.0),
         "mb_up": (12.345, 0.0), "seconds": (61.4, 0.0), "slope_ci95": (0.0, 0.001),
         "converged": True}


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip("|").split("|")]


def _by_title(table: str, label: str) -> dict[str, str]:
    header = next(line for line in table.splitlines() if line.startswith("| "))
    row = next(line for line in table.splitlines() if line.startswith(f"| {label} |"))
    return dict(zip(_cells(header), _cells(row), strict=True))


def test_compare_and_the_matrix_write_the_same_statistics_the_same_way():
    compare = _by_title(report_markdown({
        "protocol": {"seeds": [1, 2, 3], "tuning_seed": 0, "validation_fraction": 0.2,
                     "budgets": {"fedavg": 1}, "reference": "fedavg", "margin": -0.01},
        "rows": {"fedavg": {**STATS, "chosen": {}, "seeds": [1, 2, 3],
                            "rounds": {"1": list(range(1, 11))}, "curves": {"1": [0.8] * 10}}},
        "failed": []}, "compare"), "fedavg")
    matrix = _by_title(matrix_table([{
        **STATS, "label": "fedavg", "config": "lr=0.01", "grid": [{}], "tuned": True,
        "seeds": 3, "diverged_seeds": [], "unstable_seeds": [], "accuracy_stable": None,
        "per_seed": {s: {"slope": 0.0005} for s in (1, 2, 4)}, "num_rounds": 40}]), "fedavg")
    # in points, the same titles and cells
    for title, cell in (("min client (points)", "55.5"), ("slope (points/round)", "+0.05"),
                        ("seconds", "61")):
        assert compare[title] == matrix[title] == cell
    accuracy = [title for title in matrix if title.startswith("accuracy")]
    assert compare["accuracy (points, mean ± std)"] == matrix[accuracy[0]] == "81.2 ± 1.3"
    assert compare["uplink MB"] == "12.35" and matrix["uplink MB (total, a round)"] == \
        "12.35, 0.309"


def test_run_methods_writes_its_runs_in_points_with_notes_only_where_a_row_has_them():
    run = {"method": "fedavg", "accuracy_weighted": 0.8123, "accuracy_mean": 0.8, "accuracy_std":
           0.1, "accuracy_min": 0.55, "mb_up_per_round": 0.5, "mb_down_per_round": 0.5,
           "seconds_per_round": 1.234, "notes": ""}
    header, _, line = runs_table([run]).splitlines()
    assert _cells(line)[:5] == ["fedavg", "81.2", "80.0", "10.0", "55.0"]
    assert "notes" not in header
    assert _cells(runs_table([run, {**run, "notes": "n"}]).splitlines()[-1])[-1] == "n"


def test_no_statistics_table_is_written_by_hand():
    """The writers of these tables build none of their own: no Markdown separator row."""
    for path in ("comparison/report.py", "bench/evidence/tables.py", "bench/evidence/privacy.py",
                 "bench/evidence/sections.py", "bench/evidence/report.py", "bench/run_methods.py"):
        assert "---|" not in (ROOT / path).read_text(), path
