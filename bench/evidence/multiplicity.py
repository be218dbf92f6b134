"""The primary claims judged together (protocol v4): Holm's step-down correction over the
primary family (``claims.PRIMARY``), named before the re-run.

A claim holds when the 95% interval of its paired difference lies at or above its margin: a
one-sided test at ``ALPHA`` = 2.5% of "the difference is at most the margin" (Student's t over
the seeds; ``p_value`` is at most ALPHA exactly when the interval's lower end is at or above
the margin). Over the m primary claims, Holm orders them by p-value and judges the k-th at
ALPHA / (m - k + 1), stopping at the first that does not hold: the chance that any primary
claim holds falsely stays at most 2.5%, whatever their dependence. Each primary claim shows,
beside its unadjusted interval and verdict, ``ci95_adjusted`` (the interval at its step's
level, two-sided at 1 - 2 ALPHA / (m - k + 1); its lower end against the margin is the step's
test) and ``verdict_adjusted``. A claim not measured, or one that fails a condition no interval
decides (an uplink bound), counts in m and cannot hold. Every other claim is exploratory: its
interval and verdict are unadjusted, and say so.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from scipy import stats

ALPHA = 0.025  # one-sided: the level of a single claim's 95% two-sided interval


def p_value(diffs: Sequence[float], margin: float) -> float:
    """One-sided p-value of "the mean paired difference is at most ``margin``" (Student's t
    over the seeds; a spread of 0 gives 0 where the mean is at or above the margin, else 1)."""
    mean, spread = statistics.fmean(diffs), statistics.stdev(diffs)
    if spread == 0:
        return 0.0 if mean >= margin else 1.0
    return float(stats.t.sf((mean - margin) / (spread / math.sqrt(len(diffs))), len(diffs) - 1))


def interval(diffs: Sequence[float], alpha: float) -> list[float]:
    """The two-sided interval at 1 - 2 ``alpha`` of the mean paired difference."""
    mean, spread = statistics.fmean(diffs), statistics.stdev(diffs)
    half = stats.t.ppf(1 - alpha, len(diffs) - 1) * spread / math.sqrt(len(diffs))
    return [mean - half, mean + half]


def holm(records: list[dict[str, Any]]) -> None:
    """Add to each primary claim's record (``primary`` true) its p-value, Holm step and level,
    ``ci95_adjusted`` and ``verdict_adjusted``; the others are left as they are."""
    family = [r for r in records if r["primary"]]

    def p(record: dict[str, Any]) -> float:
        measured = record["verdict"] != "not measured" and len(record["paired_diffs"]) > 1
        bound = record.get("max_uplink_share")
        if not measured or (bound is not None and record["uplink_share_of_fedavg"] > bound):
            return 1.0
        return p_value(record["paired_diffs"], record["margin"])

    going = True
    for step, record in enumerate(sorted(family, key=p), 1):
        level = ALPHA / (len(family) - step + 1)
        measured = record["verdict"] != "not measured" and len(record["paired_diffs"]) > 1
        held = going and measured and p(record) <= level
        going = held
        record.update(p_value=p(record) if measured else None, holm_step=step,
                      holm_family=len(family), holm_level=level,
                      ci95_adjusted=interval(record["paired_diffs"], level) if measured else None,
                      verdict_adjusted=("not measured" if not measured
                                        else "held" if held else "did not hold"))
