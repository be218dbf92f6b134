"""Statistics over the report seeds: a row's and an ablation's mean and spread."""

from __future__ import annotations

import statistics
from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.protocol import Entry, config_tag


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for a single seed)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def row_stats(matrix: Matrix, scenario: str, item: Entry) -> dict[str, Any] | None:
    config, tuned = matrix.tuned(scenario, item, tune=False)
    cells = [c for seed in protocol.REPORT_SEEDS if (c := matrix.cell(
        scenario, item, "report", config, seed, may_run=False)) is not None]
    if not cells:
        return None

    def over_seeds(key: str) -> tuple[float, float]:
        return mean_std([c[key] for c in cells])

    return {"label": item.label, "config": config_tag(config), "tuned": tuned,
            "seeds": len(cells), "accuracy": over_seeds("accuracy_weighted"),
            "accuracy_min": over_seeds("accuracy_min"), "mb_up": over_seeds("mb_up_total"),
            "seconds": over_seeds("seconds_total"), "cells": cells}


def ablation_stats(matrix: Matrix, stats: dict[str, dict[str, dict[str, Any]]]
                   ) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Each ablation whose row is in the report, over its report seeds; keyed by scenario,
    row label and the change's tag."""
    out = {}
    for ablation in protocol.ABLATIONS:
        row = stats.get(ablation.scenario, {}).get(ablation.label)
        cells = matrix.ablation(ablation, may_run=False)
        if row is None or not cells:
            continue
        out[(ablation.scenario, ablation.label, config_tag(ablation.change))] = {
            "ablation": ablation, "row": row, "seeds": len(cells),
            "accuracy": mean_std([c["accuracy_weighted"] for c in cells]),
            "accuracy_min": mean_std([c["accuracy_min"] for c in cells])}
    return out


