"""One writer for the statistics tables: compare's report (``comparison/report.py``), the
evidence matrix's (``bench/evidence/report.py``) and ``bench/run_methods.py``'s. Each table is
a list of ``Column``s over its rows; the columns they share are written here once, and every
accuracy in them is in points (percent), as every difference and interval beside them.

Records hold fractions (``summary.json``, the cells, ``results.json``); only a table's cells
turn them into points."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from comparison.stats import seeds_named

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Column:
    """A table's column: its title and how one row's cell is written."""

    title: str
    cell: Callable[[Row], str]


def markdown_table(columns: Sequence[Column], rows: Iterable[Row]) -> str:
    """The rows as a Markdown table, one line a row, ending with a newline."""
    lines = ["| " + " | ".join(c.title for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.cell(row) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def in_points(fraction: float) -> str:
    """An accuracy (a fraction) in points: ``81.2``."""
    return f"{100 * fraction:.1f}"


def mean_std_points(mean_std: Sequence[float]) -> str:
    """A (mean, std) over seeds of an accuracy, in points: ``81.2 ± 1.3``."""
    return f"{100 * mean_std[0]:.1f} ± {100 * mean_std[1]:.1f}"


def slope_points(slope: float) -> str:
    """A slope (fraction a round) in points a round: ``+0.05``."""
    return f"{100 * slope:+.2f}"


# The columns of a row's statistics (``comparison.stats.method_stats``' keys, the matrix's
# ``row_stats`` the same): each a (mean, std, ...) over seeds
def accuracy_column(title: str = "accuracy (points, mean ± std)") -> Column:
    return Column(title, lambda row: mean_std_points(row["accuracy"]))


MIN_CLIENT = Column("min client (points)", lambda row: in_points(row["accuracy_min"][0]))


def slope_column(mark: Callable[[Row], str]) -> Column:
    """The slope over seeds, in points a round, followed by ``mark(row)`` (where it may
    still be rising)."""
    return Column("slope (points/round)", lambda row: slope_points(row["slope"][0]) + mark(row))


def uplink_column(per_round: Callable[[Row], float] | None = None) -> Column:
    """The clients' total uplink a run (MB), and with ``per_round`` a round's beside it."""
    if per_round is None:
        return Column("uplink MB", lambda row: f"{row['mb_up'][0]:.2f}")
    return Column("uplink MB (total, a round)",
                  lambda row: f"{row['mb_up'][0]:.2f}, {per_round(row):.3f}")


SECONDS = Column("seconds", lambda row: f"{row['seconds'][0]:.0f}")


def seeds_column(result: Row) -> str:
    """A table's seeds column for a row or an ablation (``seeds``: how many finished): that
    number, and the seeds it diverged on (a row's: the seeds that collapsed too, of its
    ``unstable_seeds``), e.g. ``3, collapsed on seed 2``."""
    diverged = result["diverged_seeds"]
    collapsed = [s for s in result.get("unstable_seeds", []) if s not in diverged]
    return (str(result["seeds"]) + (f", diverged on {seeds_named(diverged)}" if diverged else "")
            + (f", collapsed on {seeds_named(collapsed)}" if collapsed else ""))


def _without_unstable(row: Row) -> str:
    if not row.get("unstable_seeds"):
        return "-"
    return "none" if row["accuracy_stable"] is None else mean_std_points(row["accuracy_stable"])


# a row's accuracy over its seeds less its unstable ones (diverged or collapsed)
WITHOUT_UNSTABLE = Column("without unstable seeds", _without_unstable)
