"""Claims judged together: Holm's step-down correction over a primary family, one
implementation for the compare command (``launch/compare.py``: ``--primary``, every row
against the reference) and the evidence matrix (``bench/evidence/multiplicity.py``).

A claim holds when the 95% interval of its paired difference lies at or above its margin: a
one-sided test at ``ALPHA`` = 2.5% of "the difference is at most the margin" (Student's t over
the seeds; ``p_value`` is at most ALPHA exactly when the interval's lower end is at or above
the margin). Over the m primary claims, Holm orders them by p-value and judges the k-th at
ALPHA / (m - k + 1), stopping at the first that does not hold: the chance that any primary
claim holds falsely stays at most 2.5%, whatever their dependence. Each primary claim shows,
beside its unadjusted interval and verdict, ``ci95_adjusted`` (the interval at its step's
level, two-sided at 1 - 2 ALPHA / (m - k + 1); its lower end against the margin is the step's
test) and ``verdict_adjusted``. A claim not measured, or one that fails a condition no interval
decides (the caller's ``cannot_hold``: the matrix's uplink bound), counts in m and cannot
hold. Every other claim is exploratory: its interval and verdict are unadjusted. compare
(``judge_rows``) judges its family on the intervals alone, then calls no claim of a row with
an unstable seed (``comparison.stats.unstable``): one that held reads ``BUT_UNSTABLE``;
declining to call a claim the step-down rejected keeps its guarantee.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scipy import stats

from comparison.stats import accuracy_difference, judge_difference

ALPHA = 0.025  # one-sided: the level of a single claim's 95% two-sided interval
# what ``holm`` adds to a primary claim's record
HOLM_KEYS = ("p_value", "holm_step", "holm_family", "holm_level", "ci95_adjusted",
             "verdict_adjusted")
# a verdict that held on a row with an unstable seed (``judge_rows``): not called
BUT_UNSTABLE = "held, but unstable"


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


def holm(records: list[dict[str, Any]],
         cannot_hold: Callable[[dict[str, Any]], bool] = lambda record: False) -> None:
    """Add to each primary claim's record (``primary`` true; with its ``verdict``,
    ``paired_diffs`` and ``margin``) its p-value, Holm step and level, ``ci95_adjusted`` and
    ``verdict_adjusted``; the others are left as they are. A claim that ``cannot_hold`` is
    judged at a p-value of 1."""
    family = [r for r in records if r["primary"]]

    def measured(record: dict[str, Any]) -> bool:
        return record["verdict"] != "not measured" and len(record["paired_diffs"]) > 1

    def p(record: dict[str, Any]) -> float:
        if not measured(record) or cannot_hold(record):
            return 1.0
        return p_value(record["paired_diffs"], record["margin"])

    going = True
    for step, record in enumerate(sorted(family, key=p), 1):
        level = ALPHA / (len(family) - step + 1)
        held = going and measured(record) and p(record) <= level
        going = held
        record.update(p_value=p(record) if measured(record) else None, holm_step=step,
                      holm_family=len(family), holm_level=level,
                      ci95_adjusted=(interval(record["paired_diffs"], level)
                                     if measured(record) else None),
                      verdict_adjusted=("not measured" if not measured(record)
                                        else "held" if held else "did not hold"))


def judge_rows(rows: Mapping[str, dict[str, Any]], reference: str, family: Sequence[str],
               margin: float) -> None:
    """compare's claims, added to its rows (label -> ``method_stats`` with ``stability``):
    each row against the ``reference`` row, its paired difference (``versus_reference``) and
    verdicts (``judge_difference``), unadjusted; the rows of ``family`` judged together
    (``holm``: ``HOLM_KEYS``; a row absent from ``rows``, its runs failed, counts as not
    measured); ``primary`` on every row. A verdict that held on a row with an unstable seed
    reads ``BUT_UNSTABLE``: such a row is never called not worse or better (nor tied)."""
    base = rows.get(reference)
    for label, row in rows.items():
        row["primary"] = label in family
        if base is not None and label != reference:
            row["versus_reference"] = accuracy_difference(row, base)
            row["verdicts"] = judge_difference(row["versus_reference"], margin)
    records = []
    for label in family:
        row = rows.get(label, {})
        difference = row.get("versus_reference")
        records.append({"label": label, "primary": True, "margin": margin,
                        "verdict": row.get("verdicts", {}).get("verdict", "not measured"),
                        "paired_diffs": difference["paired_diffs"] if difference else []})
    holm(records)
    for record in records:
        if record["label"] in rows:
            rows[record["label"]].update({k: record[k] for k in HOLM_KEYS})
    for row in rows.values():
        verdicts = row.get("verdicts", {})
        for record, key in ((verdicts, "verdict"), (verdicts, "superiority"),
                            (row, "verdict_adjusted")):
            if row.get("unstable_seeds") and record.get(key) == "held":
                record[key] = BUT_UNSTABLE
