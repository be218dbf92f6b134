"""Statistics over the report seeds: a row's and an ablation's, from their cells, by the
implementation the compare command uses (``comparison/stats.py``)."""

from __future__ import annotations

from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.protocol import Entry
from comparison.stats import (
    CONVERGED_SLOPE,
    by_seed_finished,
    config_tag,
    last_rounds_mean,
    mean_std,
    method_stats,
    slope_interval,
)


def row_stats(matrix: Matrix, scenario: str, item: Entry) -> dict[str, Any] | None:
    """The row over its report seeds, and the extra seeds it ran for an undecided claim
    (None before any ran): the figures of the compare command over the seeds that finished
    (none where every one diverged: ``seeds`` 0), the seeds it diverged on, the search it
    was chosen from, and the mean task accuracy where its cells have it."""
    searched = matrix.searched(scenario, item, tune=False)
    config, tuned = matrix.reported(scenario, item)
    cells = {seed: c for seed in (*protocol.REPORT_SEEDS, *protocol.EXTRA_SEEDS)
             if (c := matrix.cell(scenario, item, "report", config, seed, may_run=False))
             is not None}
    if not cells:
        return None
    finished, diverged = by_seed_finished(list(cells.values()))
    stats = {"label": item.label, "method": item.method, "config": config_tag(config),
             "num_rounds": next(iter(cells.values()))["run_config"]["num-server-rounds"],
             "chosen": matrix.method_config(scenario, item, config), "tuned": tuned,
             "grid": [matrix.method_config(scenario, item, c) for c, _ in searched],
             "diverged": [matrix.method_config(scenario, item, c) for c, cell in searched
                          if cell is not None and cell.get("status") == "diverged"],
             # convergence is judged on the report seeds only (flag), not over extra seeds
             **({k: v for k, v in method_stats(finished).items()
                 if k not in ("slope_ci95", "converged")} if finished else {}),
             "seeds": len(finished), "diverged_seeds": diverged,
             "cells": list(finished.values())}
    if finished and all("accuracy_task_per_round" in c for c in finished.values()):
        stats["accuracy_task"] = mean_std([last_rounds_mean(c["accuracy_task_per_round"])
                                           for c in finished.values()])
    return stats


def ablation_stats(matrix: Matrix, stats: dict[str, dict[str, dict[str, Any]]]
                   ) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Each ablation whose row is in the report, over its report seeds that finished, and
    the seeds it diverged on; keyed by scenario, row label and the change's tag."""
    out = {}
    for ablation in protocol.ABLATIONS:
        row = stats.get(ablation.scenario, {}).get(ablation.label)
        cells = matrix.ablation(ablation, may_run=False)
        if row is None or not cells:
            continue
        finished, diverged = by_seed_finished(cells)
        figures = method_stats(finished) if finished else {
            "per_seed": {}, "accuracy": None, "accuracy_min": None}
        out[(ablation.scenario, ablation.label, config_tag(ablation.change))] = {
            "ablation": ablation, "row": row, "seeds": len(finished), "diverged_seeds": diverged,
            "per_seed": figures["per_seed"], "accuracy": figures["accuracy"],
            "accuracy_min": figures["accuracy_min"]}
    return out


def diverged_report_seeds(row: dict[str, Any]) -> list[int]:
    """The report seeds the row diverged on (an extra seed that diverged is named in its
    table, but rows are ranked and claims judged on the report seeds)."""
    return [s for s in row["diverged_seeds"] if s in protocol.REPORT_SEEDS]


def report_seeds_stats(row: dict[str, Any], figure: str = "accuracy") -> tuple[float, float]:
    """Mean and standard deviation of the row's ``figure`` over the report seeds it has: what
    rows are ranked by. Its mean over all its seeds would favour a row that ran
    ``EXTRA_SEEDS`` (for an undecided claim) whenever those seeds happen to be easier; on the
    report seeds every row is scored on the same splits."""
    return mean_std([f[figure] for s, f in row["per_seed"].items()
                     if s in protocol.REPORT_SEEDS])


def slope_ci95(row: dict[str, Any]) -> tuple[float, float] | None:
    """The 95% interval of the row's mean slope over its report seeds (None for one)."""
    return slope_interval([f["slope"] for s, f in row["per_seed"].items()
                           if s in protocol.REPORT_SEEDS])


def flag(row: dict[str, Any]) -> str:
    """Why a row's figure may not be its final level ("" when it has converged)."""
    interval = slope_ci95(row)
    if interval is None:
        return "one seed: convergence cannot be judged"
    if interval[1] > CONVERGED_SLOPE:
        return (f"not converged at round {row['num_rounds']}: slope over the "
                f"last 10 rounds {100 * row['slope'][0]:+.2f} points a round, 95% interval "
                f"[{100 * interval[0]:+.2f}, {100 * interval[1]:+.2f}] (converged: at most "
                f"{100 * CONVERGED_SLOPE:+.2f}; "
                + ("not doubled further: a report seed diverged at this length)"
                   if diverged_report_seeds(row) else
                   f"the rounds were doubled at most {protocol.MAX_DOUBLINGS} times)"))
    return ""
