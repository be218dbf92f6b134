"""A round's personalized evaluation on the server (``strategies/engine/evaluation.py``): who
evaluates after which round, and how the valid replies become the round's record."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

from common.protocol import CLIENT_ID, NUM_EXAMPLES, ClientReply
from strategies.engine.accounting import RoundLedger
from strategies.engine.evaluation import PendingEvaluation
from strategies.registry import load_settings
from tests.conftest import app_config


def _pending(**overrides) -> tuple[PendingEvaluation, RoundLedger]:
    ledger = RoundLedger()
    return PendingEvaluation(load_settings(app_config(**overrides)), ledger), ledger


def _reply(client_id: str, accuracy: float, examples: int) -> ClientReply:
    return ClientReply(node_id=0, client_id=client_id, arrays=ArrayRecord(),
                       metrics=MetricRecord({NUM_EXAMPLES: examples, "accuracy": accuracy}),
                       info=ConfigRecord({CLIENT_ID: client_id}))


def test_a_sampled_evaluation_becomes_everyone_after_the_last_round():
    """The final figure is over every client, whatever share evaluated the rounds before;
    an evaluation switched off stays off."""
    pending, _ = _pending(**{"fraction-evaluate": 0.2, "num-server-rounds": 5})
    assert [pending.fraction(r) for r in (1, 4, 5)] == [0.2, 0.2, 1.0]
    switched_off, _ = _pending(**{"fraction-evaluate": 0.0, "num-server-rounds": 5})
    assert switched_off.fraction(5) == 0.0


def test_a_rounds_accuracy_weighs_each_client_by_its_test_examples():
    """Evaluate replies and evaluations carried by train replies count alike, each client by
    the test examples it reported, listed in client order."""
    pending, ledger = _pending()
    pending.record_replies(3, [_reply("10", 0.5, 10)], fused=[_reply("9", 1.0, 30)])
    stats = ledger.record(3).eval
    assert stats["accuracy_weighted"] == pytest.approx(0.875)  # (30 * 1.0 + 10 * 0.5) / 40
    assert list(stats["per_client"]) == ["9", "10"]  # numeric ids in numeric order


def test_only_a_rejoined_clients_first_score_goes_to_rejoined():
    """A client back on a new node: its first accuracy shows whether its personal state
    came back; later rounds are ordinary."""
    pending, ledger = _pending()
    pending.expect_rejoined(["2"])
    pending.record(4, {"2": (0.6, 10), "3": (0.9, 10)})
    pending.record(5, {"2": (0.7, 10)})
    assert ledger.record(4).extra["rejoined"] == {"2": 0.6}
    assert "rejoined" not in ledger.record(5).extra
