"""Bounded influence on the shared model (docs/security.md).

- **Example counts.** A reply claiming more than ``aggregation.max-num-examples`` is dropped
  at validation (``common.protocol.parse_reply``); ``ExampleCounts`` then holds each client's
  count at its first accepted report, per stage: a later, larger claim weighs only as much as
  the first (a site cannot raise its weight once it has joined).
- **Robust rules** for the shared part (``aggregation.rule``): ``mean`` (example-weighted;
  Flower's ``aggregate_arrayrecords``), ``median`` (coordinate-wise, as Flower's
  ``FedMedian``), ``trimmed-mean`` (coordinate-wise, ``aggregation.trim-fraction`` cut at
  each end; Flower's ``trim_mean`` of ``FedTrimmedAvg``). The median and the trimmed mean
  ignore example counts: every client counts once.
- **Update-norm clipping** (``aggregation.clip-norm`` > 0): each client's update (its upload
  minus the arrays the round started from) is scaled to at most that L2 norm over all of its
  shared arrays before the rule (Flower's ``compute_clip_model_update``, as in its
  ``DifferentialPrivacyServerSideFixedClipping`` without the noise).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from logging import WARNING

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from flwr.supercore.differential_privacy import compute_clip_model_update

from common.config import RunSettings
from common.protocol import ARRAYS, METRICS, NUM_EXAMPLES, ClientReply

WEIGHT = "aggregation-weight"  # the weight of one reply in the plain mean


class ExampleCounts:
    """Each client's ``num-examples`` as first reported, per stage (``pinned``: client id ->
    stage -> count; a per-client table, checkpointed and expired with the others)."""

    def __init__(self) -> None:
        self.pinned: dict[str, dict[str, int]] = {}

    def forget(self, client_id: str) -> None:
        """An expired client id: its next report is a first one."""
        self.pinned.pop(client_id, None)

    def state(self) -> dict[str, dict[str, int]]:
        return self.pinned

    def restore(self, state: dict[str, dict[str, int]]) -> None:
        self.pinned = {client: dict(counts) for client, counts in state.items()}

    def bound(self, stage: str, replies: list[ClientReply]) -> list[ClientReply]:
        """The replies, each whose ``num-examples`` exceeds its client's first report of
        ``stage`` replaced by a copy carrying that first report (the replies given are left
        as they were)."""
        bounded = []
        for reply in replies:
            first = self.pinned.setdefault(reply.client_id, {}).setdefault(
                stage, reply.num_examples)
            if reply.num_examples > first:
                log(WARNING, "client %s reports %d %s examples, first %d: weighted as %d",
                    reply.client_id, reply.num_examples, stage, first, first)
                reply = replace(reply, metrics=MetricRecord({**reply.metrics,
                                                             NUM_EXAMPLES: first}))
            bounded.append(reply)
        return bounded


def is_plain_mean(settings: RunSettings) -> bool:
    return settings.aggregation == "mean" and settings.clip_norm == 0


def combine(uploads: list[Mapping[str, np.ndarray]], weights: list[float],
            reference: Mapping[str, np.ndarray], settings: RunSettings
            ) -> dict[str, np.ndarray]:
    """The shared arrays (float64) from the clients' ``uploads`` (key -> values, the same keys
    and shapes as ``reference``, the arrays the round started from), by the run's
    ``aggregation.*`` rule; ``weights`` are used by ``mean`` only."""
    keys = list(reference)
    rows = [[np.asarray(u[k], np.float64) for k in keys] for u in uploads]
    if settings.clip_norm > 0:
        start = [np.asarray(reference[k], np.float64) for k in keys]
        for values in rows:
            compute_clip_model_update(values, start, settings.clip_norm)
    out = {}
    for i, name in enumerate(keys):
        stacked = np.stack([values[i] for values in rows])
        if settings.aggregation == "median":
            out[name] = np.median(stacked, axis=0)
        elif settings.aggregation == "trimmed-mean":
            out[name] = trim_mean(stacked, settings.trim_fraction)
        else:
            share = np.asarray(weights, np.float64) / float(np.sum(weights))
            out[name] = np.tensordot(share, stacked, axes=1)
    return out


def aggregate(replies: list[ClientReply], keys: list[str], reference: ArrayRecord,
              settings: RunSettings, uniform: bool = False,
              dtype: np.dtype | None = None) -> ArrayRecord:
    """``keys`` of the replies' arrays aggregated by the run's rule: Flower's
    ``aggregate_arrayrecords`` for the plain mean (weighted by examples, or every client once
    when ``uniform``), else ``combine``; with ``dtype`` (float64: a mean a method goes on
    computing with), ``combine`` for every rule, the arrays in that dtype."""
    weights = [1 if uniform else r.num_examples for r in replies]
    if is_plain_mean(settings) and dtype is None:
        return aggregate_arrayrecords([RecordDict({
            ARRAYS: ArrayRecord({k: r.arrays[k] for k in keys}),
            METRICS: MetricRecord({WEIGHT: weight})})
            for r, weight in zip(replies, weights, strict=True)], WEIGHT)
    merged = combine([{k: r.arrays[k].numpy() for k in keys} for r in replies], weights,
                     {k: reference[k].numpy() for k in keys}, settings)
    return ArrayRecord({k: Array(merged[k].astype(
        reference[k].numpy().dtype if dtype is None else dtype)) for k in keys})
