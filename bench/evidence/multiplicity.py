"""The primary claims judged together (protocol v4): Holm's step-down correction over the
primary family (``claims.PRIMARY``), named before the re-run, by the implementation the
compare command uses (``comparison/multiplicity.py``: ``ALPHA``, ``p_value``, ``interval``,
``holm``; what a claim's ``ci95_adjusted`` and ``verdict_adjusted`` mean).

Here a claim with an uplink bound (``max_uplink_share`` of FedAvg's) that its row misses
counts in the family and cannot hold, whatever its interval; every other claim is
exploratory: its interval and verdict are unadjusted, and say so.
"""

from __future__ import annotations

from typing import Any

from comparison import multiplicity


def over_uplink_bound(record: dict[str, Any]) -> bool:
    """Whether a claim's row sends more than its bound allows (no bound: False)."""
    bound = record.get("max_uplink_share")
    return bound is not None and record["uplink_share_of_fedavg"] > bound


def holm(records: list[dict[str, Any]]) -> None:
    """Add to each primary claim's record (``primary`` true) its p-value, Holm step and level,
    ``ci95_adjusted`` and ``verdict_adjusted``; the others are left as they are."""
    multiplicity.holm(records, cannot_hold=over_uplink_bound)
