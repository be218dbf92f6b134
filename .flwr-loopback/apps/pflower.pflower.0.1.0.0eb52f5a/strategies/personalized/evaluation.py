"""Personalized evaluation: every sampled client scores its own model on its own test split.

Two protocols give the same numbers (a test checks it):

- ``fused-evaluation = false``: after round ``r``'s training, an evaluate exchange with the
  clients sampled for evaluation (``E_r``).
- ``fused-evaluation = true`` (default): the evaluation after round ``r`` is the evaluation of
  what a client receives at the start of round ``r + 1``, before it trains: the clients of
  ``E_r`` that are sampled for training in round ``r + 1`` evaluate first and report both in
  their train reply (``eval-*`` metrics); the others get an evaluate message in the same
  exchange; after the last round, one evaluate exchange. A round costs one exchange instead of
  two. ``E_r`` is drawn at the same point of the run as in the other protocol, so sampling is
  the same too.
"""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, MessageType, MetricRecord
from flwr.common.logger import log

from common.protocol import (
    EVAL_ACCURACY,
    EVAL_CPU,
    EVAL_EXAMPLES,
    EVALUATE_METRICS,
    NUM_EXAMPLES,
    ClientReply,
    ReplyError,
)
from common.record import RoundRecord, personalized_stats
from strategies.personalized.replies import stop_if_every_reply_failed


def fused_evaluation(reply: ClientReply) -> ClientReply:
    """The evaluation a valid train reply carries, as an evaluate reply of the same client
    (``num-examples``: its test examples, ``accuracy``, and ``eval-cpu-seconds``). Raises
    ``ReplyError`` if the ``eval-*`` metrics are missing or malformed (their ranges are
    checked with every metric, ``common.protocol.METRIC_RANGES``)."""
    accuracy = reply.metrics.get(EVAL_ACCURACY)
    examples = reply.metrics.get(EVAL_EXAMPLES)
    if not isinstance(accuracy, float) or not isinstance(examples, int) or examples <= 0:
        raise ReplyError(f"train reply lacks a valid {EVAL_ACCURACY}/{EVAL_EXAMPLES}")
    return ClientReply(reply.node_id, reply.client_id, ArrayRecord(), MetricRecord(
        {NUM_EXAMPLES: examples, "accuracy": accuracy,
         EVAL_CPU: float(reply.metrics.get(EVAL_CPU, 0.0))}), reply.info)


class Evaluation:
    """The evaluation side of ``PersonalizedStrategy`` (attributes set up there)."""

    def record_evaluation(self, server_round: int, scores: dict[str, tuple[float, int]]) -> None:
        """Round ``server_round``'s personalized statistics from ``scores`` (client id ->
        (accuracy, test examples)); rejoined clients' first scores go to ``rejoined``."""
        rejoined = {c: a for c, (a, _) in scores.items() if c in self._rejoined_at_evaluate}
        if rejoined:
            self._record_rejoined(server_round, rejoined)
            self._rejoined_at_evaluate.difference_update(rejoined)
        if not scores:
            return
        stats = personalized_stats(scores)
        self.ledger.record(server_round).eval = stats
        self.per_client_accuracy.update(stats["per_client"])
        log(INFO, "round %d: personalized accuracy weighted %.4f mean %.4f min %.4f "
            "(%d clients)", server_round, stats["accuracy_weighted"], stats["accuracy_mean"],
            stats["accuracy_min"], stats["num_clients"])

    @staticmethod
    def scores_of(replies: list[ClientReply]) -> dict[str, tuple[float, int]]:
        return {r.client_id: (float(r.metrics["accuracy"]), r.num_examples) for r in replies}

    def evaluate_round(self, grid: Any, server_round: int, arrays: ArrayRecord) -> None:
        """The evaluate exchange of round ``server_round`` (the two-exchange protocol, and
        the last round of the fused one: then with the clients drawn at its end)."""
        with self.ledger.server_cpu(server_round):
            if self.pending_evaluation is None:
                self.draw_evaluation(grid, server_round, arrays)
            clients, self.pending_evaluation = self.pending_evaluation, None
            messages = self._addressed(server_round, clients, arrays, MessageType.EVALUATE,
                                       server_round)
        batch = self.send(grid, messages)
        with self.ledger.server_cpu(server_round):
            valid = self.validate(server_round, "evaluate", batch, EVALUATE_METRICS)
            stop_if_every_reply_failed(f"evaluation of round {server_round}", server_round,
                                       batch, self.settings.min_nodes)
            self.ledger.client_cpu(server_round, "evaluate", valid)
            self.record_evaluation(server_round, self.scores_of(valid))

    def draw_evaluation(self, grid: Any, server_round: int, arrays: ArrayRecord) -> None:
        """Draw the clients that evaluate round ``server_round`` (``E_r``): a
        ``fraction-evaluate`` share, everyone after the last round."""
        last = server_round == self.settings.num_server_rounds
        fraction = 1.0 if last and self.settings.fraction_evaluate > 0 else \
            self.settings.fraction_evaluate
        self.pending_evaluation = self._pick(server_round, arrays, grid, fraction,
                                             MessageType.EVALUATE)

    # ------------------------------------------------------------------ checkpoint
    def pending_state(self, server_round: int) -> dict[str, Any] | None:
        """What a resumed run needs of an evaluation still to come: the round, its record so
        far, and the client ids drawn for it."""
        if self.pending_evaluation is None:
            return None
        clients = [c for c in self.pending_evaluation.values() if c is not None]
        if len(clients) < len(self.pending_evaluation):
            log(WARNING, "checkpoint: %d nodes drawn for evaluation have no client id yet",
                len(self.pending_evaluation) - len(clients))
        return {"round": server_round, "clients": clients,
                "record": asdict(self.ledger.record(server_round))}

    def restore_pending(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        self.ledger.history[state["round"]] = RoundRecord(**state["record"])
        self._pending_clients = set(state["clients"])

    def resolve_pending(self) -> None:
        """After a resume: the drawn clients' current nodes (identified at the start)."""
        if self._pending_clients is not None:
            self.pending_evaluation = {n: self.nodes.client_of(n)
                                       for n in self.nodes.nodes_of(self._pending_clients)}
            self._pending_clients = None
