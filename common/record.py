"""What one round records, and its form in ``results.json`` (contracts §3 and §4).

The strategy fills a ``RoundRecord`` per round; ``RoundRecord.entry`` is the round's object in
``results.json``. A method adds its own per-round values with ``Strategy.report``
(they land in ``extra`` and appear as top-level fields of the round's entry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from common.protocol import NO_REPLY, NOT_FINITE, client_order


@dataclass
class RoundRecord:
    """What happened in one round."""

    bytes_up: int = 0
    bytes_down_train: int = 0
    bytes_down_evaluate: int = 0
    train: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    dropped: list[dict[str, Any]] = field(default_factory=list)
    # CPU seconds: clients' train/evaluate handlers (their ``cpu-seconds`` metric, summed) and
    # the server's strategy work (message building, validation, aggregation)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    # wall time: the clients' phases per stage (sums, with the number of messages) and the
    # server's wait for each exchange
    client_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    exchange_seconds: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific, e.g. similarities

    def add_cpu(self, name: str, seconds: float) -> None:
        self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + seconds

    def entry(self, server_round: int, seconds: float) -> dict[str, Any]:
        """The round's object in ``results.json``."""
        entry: dict[str, Any] = {
            "round": server_round, "seconds": seconds, "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down_train + self.bytes_down_evaluate,
            "bytes_down_train": self.bytes_down_train,
            "bytes_down_evaluate": self.bytes_down_evaluate}
        if self.train is not None:
            entry["train"] = self.train
        if self.eval is not None:
            entry["eval"] = self.eval
        if self.dropped:
            entry["dropped"] = self.dropped
        if self.cpu_seconds:
            entry["cpu_seconds"] = self.cpu_seconds
        if self.client_seconds:
            entry["client_seconds"] = self.client_seconds
        if self.exchange_seconds:
            entry["exchange_seconds"] = self.exchange_seconds
        entry.update(self.extra)
        return entry


def personalized_stats(per_client: dict[str, tuple[float, int]],
                       task_accuracy: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Contracts §3: weighted/mean/std/min accuracy over clients, plus the per-client map
    (``per_client``: client id -> (accuracy, test examples)); and ``accuracy_task_mean``, the
    unweighted mean over clients of their task accuracy (``task_accuracy``: client id -> its
    balanced accuracy on its test split) when any of them reported one. A client of
    ``per_client`` that did not report one is left out of that mean, and then
    ``accuracy_task_num_clients`` says how many are in it; a task accuracy of a client not in
    ``per_client`` is ignored."""
    accuracy = np.array([a for a, _ in per_client.values()])
    examples = np.array([n for _, n in per_client.values()], dtype=float)
    stats: dict[str, Any] = {
        "accuracy_weighted": float((accuracy * examples).sum() / examples.sum()),
        "accuracy_mean": float(accuracy.mean()),
        "accuracy_std": float(accuracy.std()),
        "accuracy_min": float(accuracy.min()),
        "num_clients": len(per_client),
        "per_client": {cid: a for cid, (a, _) in sorted(per_client.items(),
                                                        key=lambda kv: client_order(kv[0]))},
    }
    task = [float(t) for cid, t in sorted((task_accuracy or {}).items(),
                                          key=lambda kv: client_order(kv[0]))
            if cid in per_client]
    if task:
        stats["accuracy_task_mean"] = float(np.mean(task))
        if len(task) < len(per_client):
            stats["accuracy_task_num_clients"] = len(task)
    return stats


def dropped_as_non_finite(drop: Mapping[str, Any], stage: str | None = None) -> bool:
    """Whether a ``dropped`` entry (``RoundRecord.dropped``) is a reply dropped because a
    value was not finite, at ``stage`` (``train`` or ``evaluate``; either where None)."""
    return NOT_FINITE in drop.get("reason", "") and stage in (None, drop.get("stage"))


def lost_to_timeout(rounds: Sequence[Mapping[str, Any]]) -> str | None:
    """From a run's round entries (``results.json``'s ``rounds``): the replies that did not
    arrive within the round-timeout, in any round, as one line ("round r: N reply(ies) lost
    (the reason)", r the first round that lost one); None where none was."""
    for entry in rounds:
        lost = [d for d in entry.get("dropped", []) if NO_REPLY in d.get("reason", "")]
        if lost:
            return f"round {entry['round']}: {len(lost)} reply(ies) lost ({lost[0]['reason']})"
    return None


def lost_to_non_finite(rounds: Sequence[Mapping[str, Any]], last_evaluated: int,
                       stage: str | None = None) -> str | None:
    """From a run's round entries (``results.json``'s ``rounds``): the clients whose replies
    were dropped as not finite (at ``stage``, ``train`` or ``evaluate``; at either where
    None) from the first of the last ``last_evaluated`` evaluated rounds on, as one line
    ("rounds a-b: the replies of N client(s) were not finite (a reason)", or "round b: ...",
    the reason the least in sort order: the line does not depend on the order of the drops);
    None where none was. A client dropped at evaluation is missing from those rounds'
    accuracy; one dropped at training is not, but its update was left out."""
    if last_evaluated < 1:
        raise ValueError(f"last_evaluated must be at least 1, not {last_evaluated}")
    evaluated = [r["round"] for r in rounds if "eval" in r]
    if not evaluated:
        return None
    first = evaluated[-last_evaluated:][0]
    lost = [d for r in rounds if r["round"] >= first for d in r.get("dropped", [])
            if dropped_as_non_finite(d, stage)]
    if not lost:
        return None
    clients = len({d.get("client", "?") for d in lost})
    last = rounds[-1]["round"]
    span = f"round {last}" if first == last else f"rounds {first}-{last}"
    return (f"{span}: the replies of {clients} client(s) were "
            f"not finite ({min(d['reason'] for d in lost)})")
