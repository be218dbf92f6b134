"""The evidence matrix's tables, written by ``comparison.table``'s one writer (in points): a
scenario's rows and the ablations against their rows."""

from __future__ import annotations

from typing import Any

from bench.evidence import protocol
from bench.evidence.stats import flag, uplink_per_round
from comparison.stats import accuracy_difference, config_tag, points
from comparison.table import (
    MIN_CLIENT,
    SECONDS,
    WITHOUT_UNSTABLE,
    Column,
    Row,
    accuracy_column,
    in_points,
    markdown_table,
    mean_std_points,
    seeds_column,
    slope_column,
    uplink_column,
)


def _configuration(row: Row) -> str:
    return (f"{row['config']} ({len(row['grid'])})" if row["tuned"]
            else f"{row['config']} (not tuned yet)")


def _at_base(row: Row) -> str:
    if "at_base" not in row:
        return "-"
    return f"{mean_std_points(row['at_base']['accuracy'])} ({row['at_base']['rounds']})"


ROW_COLUMNS = [
    Column("method", lambda row: row["label"]),
    Column("chosen configuration (of searched)", _configuration),
    Column("seeds, unstable", seeds_column),
    accuracy_column("accuracy, last 5 rounds (points, mean ± std)"),
    WITHOUT_UNSTABLE,
    Column("at base rounds", _at_base),
    Column("task accuracy (points)", lambda row: mean_std_points(row["accuracy_task"])
           if "accuracy_task" in row else "-"),
    MIN_CLIENT,
    slope_column(lambda row: " ⚑" if flag(row) else ""),
    uplink_column(uplink_per_round),
    SECONDS,
]


def table(rows: list[dict[str, Any]]) -> str:
    """A scenario's rows (``row_stats``), in points."""
    return markdown_table(ROW_COLUMNS, rows)


# an ablation's table: (key of its record, title)
ABLATION_COLUMNS = [Column(title, lambda record, key=key: record[key]) for key, title in (
    ("row", "row"), ("change", "change"), ("question", "question"), ("seeds", "seeds"),
    ("accuracy", "accuracy, last 5 rounds (points, mean ± std)"),
    ("min", "min client (points)"), ("row_accuracy", "row's accuracy (points)"),
    ("difference", "difference (points) [95% interval]"))]


def _ablation_record(result: dict[str, Any]) -> dict[str, str]:
    ablation, row = result["ablation"], result["row"]
    difference = accuracy_difference(result, row)
    ran = result["accuracy"] is not None
    return {"row": f"{ablation.scenario}/{ablation.label} ({row['config']})",
            "change": config_tag(ablation.change), "question": ablation.question,
            "seeds": seeds_column(result),
            "accuracy": mean_std_points(result["accuracy"]) if ran else "diverged on every seed",
            "min": in_points(result["accuracy_min"][0]) if ran else "",
            "row_accuracy": in_points(row["accuracy"][0]),
            "difference": "no common seed" if difference is None else points(difference)}


def ablation_table(ablated: dict[tuple[str, str, str], dict[str, Any]],
                   redundant: list[protocol.Ablation]) -> str:
    """Each ablation against its row, both on the report seeds: the paired difference and its
    95% interval, as a claim is judged; and those not run because the row's tuned
    configuration already has their change."""
    if not ablated and not redundant:
        return ""
    not_run = [{"row": f"{a.scenario}/{a.label}", "change": config_tag(a.change),
                "question": a.question, "seeds": "-",
                "accuracy": "not run: the row's tuned configuration already has this change",
                "min": "", "row_accuracy": "", "difference": ""} for a in redundant]
    return markdown_table(ABLATION_COLUMNS,
                          [*not_run, *map(_ablation_record, ablated.values())])
