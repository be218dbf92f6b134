"""Statistics over the report seeds: a row's and an ablation's, from their cells, by the
implementation the compare command uses (``comparison/stats.py``, the unstable-seed rule
included: ``collapsed``, ``unstable``)."""

from __future__ import annotations

from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.mechanism import MU_DENSITY, MU_DENSITY_MISSING
from bench.evidence.protocol import Entry
from bench.evidence.rounds import prefix
from comparison.stats import (
    CONVERGED_SLOPE,
    by_seed_finished,
    config_tag,
    last_rounds_mean,
    mean_std,
    method_stats,
    slope_interval,
    unstable,
)


def row_stats(matrix: Matrix, scenario: str, item: Entry) -> dict[str, Any] | None:
    """The row over its report seeds (None before any ran): the figures of the compare
    command over the seeds that finished (none where every one diverged: ``seeds`` 0), at the
    scenario's rounds and, where those are longer, at its base rounds (``at_base``, each run's
    prefix); the seeds it diverged on, its unstable seeds (diverged or collapsed) and its mean
    without them; the search it was chosen from; its validation figure at the scenario's
    rounds (what references are chosen by); the mean task accuracy and, for Factorized-FL, mu's
    density where its cells have them."""
    searched = matrix.searched(scenario, item, tune=False)
    config, tuned = matrix.reported(scenario, item)
    cells = {seed: c for seed in protocol.REPORT_SEEDS
             if (c := matrix.cell(scenario, item, "report", config, seed, may_run=False))
             is not None}
    if not cells:
        return None
    finished, diverged = by_seed_finished(list(cells.values()))
    shaky = unstable(cells)
    stable = {s: c for s, c in finished.items() if s not in shaky}
    resolved = matrix.method_config(scenario, item, config)
    rounds, base = matrix.rounds(scenario), matrix.base_rounds(scenario)
    stats = {"label": item.label, "method": item.method, "config": config_tag(config),
             "num_rounds": next(iter(cells.values()))["run_config"]["num-server-rounds"],
             "base_rounds": base, "rounds_fixed": rounds is not None,
             "local_epochs": matrix.store.resolved(matrix.run_config(
                 scenario, item, "report", config, 0, matrix.out))["local-epochs"],
             "chosen": resolved, "tuned": tuned,
             "grid": [matrix.method_config(scenario, item, c) for c, _ in searched],
             "diverged": [matrix.method_config(scenario, item, c) for c, cell in searched
                          if cell is not None and cell.get("status") == "diverged"],
             # convergence is judged on the report seeds only (flag)
             **({k: v for k, v in method_stats(finished).items()
                 if k not in ("slope_ci95", "converged")} if finished else {}),
             "seeds": len(finished), "diverged_seeds": diverged,
             "unstable_seeds": list(shaky), "unstable_why": shaky,
             "accuracy_stable": mean_std([last_rounds_mean(c["accuracy_per_round"],
                                                           rounds=c.get("rounds"))
                                          for c in stable.values()]) if stable else None,
             "validation": matrix.validation(scenario, item),
             "cells": list(finished.values())}
    if finished and stats["num_rounds"] > base:
        short = {s: prefix(c, base) for s, c in finished.items()}
        stats["at_base"] = {"rounds": base, **{k: v for k, v in method_stats(short).items()
                                               if k in ("accuracy", "per_seed", "mb_up")}}
    if finished and all("accuracy_task_per_round" in c for c in finished.values()):
        stats["accuracy_task"] = mean_std([last_rounds_mean(c["accuracy_task_per_round"])
                                           for c in finished.values()])
    if item.method == "factorized-fl":
        densities = [c.get(MU_DENSITY) for c in finished.values()]
        stats["mu_density"] = (mean_std(densities)[0] if densities and None not in densities
                               else None)
        if stats["mu_density"] is None:
            stats["mu_density_missing"] = MU_DENSITY_MISSING
    return stats


def ablation_stats(matrix: Matrix, stats: dict[str, dict[str, dict[str, Any]]]
                   ) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Each ablation whose row is in the report, over its seeds that finished, and the seeds it
    diverged on; keyed by scenario, row label and the change's tag."""
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
    """The report seeds the row diverged on."""
    return [s for s in row["diverged_seeds"] if s in protocol.REPORT_SEEDS]


def report_seeds_stats(row: dict[str, Any], figure: str = "accuracy") -> tuple[float, float]:
    """Mean and standard deviation of the row's ``figure`` over the report seeds it has: what
    rows are ranked by."""
    return mean_std([f[figure] for s, f in row["per_seed"].items()
                     if s in protocol.REPORT_SEEDS])


def uplink_per_round(row: dict[str, Any]) -> float:
    """The row's uplink in MB a round (its total over its rounds)."""
    return row["mb_up"][0] / row["num_rounds"]


def slope_ci95(row: dict[str, Any]) -> tuple[float, float] | None:
    """The 95% interval of the row's mean slope over its report seeds (None for one)."""
    return slope_interval([f["slope"] for s, f in row["per_seed"].items()
                           if s in protocol.REPORT_SEEDS])


def flag(row: dict[str, Any]) -> str:
    """Why a row's figure may not be its final level ("" when its report seeds' curves have
    converged): informative only, its rounds were fixed on validation before they ran."""
    interval = slope_ci95(row)
    if interval is None:
        return "one seed: convergence cannot be judged"
    if interval[1] > CONVERGED_SLOPE:
        return (f"not converged at round {row['num_rounds']}: slope over the "
                f"last 10 rounds {100 * row['slope'][0]:+.2f} points a round, 95% interval "
                f"[{100 * interval[0]:+.2f}, {100 * interval[1]:+.2f}] (converged: at most "
                f"{100 * CONVERGED_SLOPE:+.2f}; the scenario's rounds were fixed on validation "
                f"before any report seed ran, at most {protocol.MAX_DOUBLINGS} doublings)")
    return ""
