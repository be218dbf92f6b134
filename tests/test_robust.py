"""Bounded influence on the shared model (docs/security.md, ``strategies/engine/robust.py``):
example counts held at a client's first report, update clipping before the mean, and the
coordinate-wise rules against one attacker."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from common.protocol import NUM_EXAMPLES, ClientReply
from strategies.engine.robust import ExampleCounts, aggregate, combine
from strategies.registry import load_settings
from tests.conftest import app_config


def test_bounding_example_counts_leaves_the_replies_it_reads_as_they_were():
    def reply(examples: int) -> ClientReply:
        return ClientReply(100, "0", ArrayRecord(), MetricRecord({NUM_EXAMPLES: examples}),
                           ConfigRecord())

    counts = ExampleCounts()
    counts.bound("train", [reply(50)])
    inflated = reply(5000)
    [bounded] = counts.bound("train", [inflated])
    assert bounded.num_examples == 50 and inflated.num_examples == 5000
    # one example more is already more weight than the first report: bounded too
    assert [r.num_examples for r in counts.bound("train", [reply(51), reply(49)])] == [50, 49]


def test_the_mean_with_update_clipping_clips_before_averaging():
    """``aggregation.rule = "mean"`` with ``aggregation.clip-norm``: the replies go through the
    clip, not Flower's plain mean: an attacker's update 1000 long moves the mean by at most
    its share of the clip norm."""
    settings = load_settings(app_config(**{"aggregation.clip-norm": 1.0}))
    start = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
    replies = [ClientReply(100 + i, str(i), ArrayRecord({"w": Array(np.full(4, v, np.float32))}),
                           MetricRecord({NUM_EXAMPLES: 10}), ConfigRecord())
               for i, v in enumerate([0.1, 0.1, 0.1, -1000.0])]
    merged = aggregate(replies, ["w"], start, settings)["w"].numpy()
    np.testing.assert_allclose(merged, (3 * 0.1 - 0.5) / 4, rtol=1e-6)


@pytest.mark.parametrize(("rule", "clip"), [("median", 0.0), ("trimmed-mean", 0.0),
                                            ("mean", 1.0)])
def test_robust_rules_bound_one_attacker(rule, clip):
    settings = load_settings(app_config(**{"aggregation.rule": rule,
                                           "aggregation.clip-norm": clip,
                                           "aggregation.trim-fraction": 0.2}))
    start = {"w": np.zeros(4)}
    honest = [{"w": np.full(4, 0.1 + 0.01 * i)} for i in range(4)]
    attacker = {"w": np.full(4, -1000.0)}
    out = combine([*honest, attacker], [10] * 5, start, settings)["w"]
    if clip:  # every update is at most 1.0 long: the attacker moves the mean by <= 0.2
        assert np.linalg.norm(out - np.mean([h["w"] for h in honest], 0) * 0.8) <= 0.2 + 1e-9
    else:
        assert np.all((out >= 0.1) & (out <= 0.13))
