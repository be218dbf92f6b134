"""Protocol v4's rounds: one count R a scenario, fixed before any report seed runs, on the
tuning runs' validation curves; and a report run read at fewer rounds than it ran.

R is the smallest of the scenario's base rounds and their doublings (at most
``protocol.MAX_DOUBLINGS``) at which every row's tuning run (tuning pool, tuning seed,
validation splits) at its chosen configuration has converged on validation
(``validation_converged``): the least-squares slope of its curve over the last
``SLOPE_ROUNDS`` rounds at most ``CONVERGED_SLOPE`` (0.1 points a round, a margin per 10
rounds), the rule the report seeds' curves were held to in v3, on one curve: the tuning seed
is one run, and an interval over seeds needs several. A tuning run that diverged at a length is
settled there (more rounds cannot undo a run that replays the shorter one). The last length
is R whatever its curves do. So the rows of a scenario are compared at equal rounds, and no
decision about rounds reads a report seed. Each length runs every row (``Matrix.rounds``),
one tuning cell a row, only where the one before did not settle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bench.evidence import protocol
from comparison.stats import CONVERGED_SLOPE, slope

ROUNDS_CHOSEN_ON = "validation"
CURVES = ("accuracy_per_round", "accuracy_min_per_round", "accuracy_task_per_round")


def lengths(base: int) -> list[int]:
    """The round counts a scenario of ``base`` rounds may run: base and its doublings."""
    return [base << doubling for doubling in range(protocol.MAX_DOUBLINGS + 1)]


def at_length(config: dict[str, Any], rounds: int, base: int) -> dict[str, Any]:
    """A configuration at ``rounds``: the configuration itself at the base rounds (the
    search's own cell), else with ``num-server-rounds`` set."""
    return dict(config) if rounds == base else {**config, "num-server-rounds": rounds}


def validation_converged(cell: Mapping[str, Any]) -> bool:
    """Whether a tuning run's validation curve has stopped rising (or it diverged)."""
    if cell.get("status") == "diverged":
        return True
    return slope(cell["accuracy_per_round"]) <= CONVERGED_SLOPE


def validation_slope(cell: Mapping[str, Any]) -> float | None:
    """The slope ``validation_converged`` reads (None where the run diverged)."""
    return None if cell.get("status") == "diverged" else slope(cell["accuracy_per_round"])


def ran_rounds(cell: Mapping[str, Any]) -> int:
    return int(cell["run_config"]["num-server-rounds"])


def prefix(cell: dict[str, Any], rounds: int) -> dict[str, Any]:
    """A run read at ``rounds``, fewer than it ran: a run here is deterministic and a longer
    one replays a shorter one round by round on the same machine (295 of 295 such pairs of v3's
    cells on one machine; 20 pairs across machines differ, as any re-run there does), so
    its first ``rounds`` are the shorter run. Its curves are cut there: where it evaluated
    every k-th round (``evaluate-every``), its prefix has those rounds, not the shorter run's
    last ten, and its figure is read on them. Uplink is counted over the first ``rounds``
    rounds, seconds pro rata. A run that diverged stays diverged (its curve is not stored)."""
    total = ran_rounds(cell)
    if cell.get("status") == "diverged" or total <= rounds:
        return cell
    keep = [i for i, r in enumerate(cell["rounds"]) if r <= rounds]
    up = cell.get("mb_up_per_round")
    return {**cell, "rounds": [cell["rounds"][i] for i in keep],
            **{k: [cell[k][i] for i in keep] for k in CURVES if k in cell},
            "mb_up_total": sum(up[:rounds]) if up else cell["mb_up_total"] * rounds / total,
            "seconds_total": cell["seconds_total"] * rounds / total, "read_at_rounds": rounds}
