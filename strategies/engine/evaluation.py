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

``PendingEvaluation`` owns round ``r``'s evaluation from the draw to the record: ``draw``
(at the end of round ``r``), ``take`` (round ``r + 1`` carries it, or the evaluate exchange
sends it), ``split_off`` (the fused replies, out of round ``r + 1``'s exchange), ``record``
(results.json shows round ``r`` once its evaluation is in: one round late with fused
evaluation, ``server_app/rounds.py``), and ``state`` / ``restore`` / ``resolve`` (a
checkpoint taken between the draw and the exchange).
"""

from __future__ import annotations

from dataclasses import asdict
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log

from common.config import RunSettings
from common.protocol import (
    EVAL_ACCURACY,
    EVAL_CPU,
    EVAL_EXAMPLES,
    EVAL_TASK_ACCURACY,
    EVALUATE_METRICS,
    NUM_EXAMPLES,
    TASK_ACCURACY,
    ClientReply,
    ReplyError,
    client_order,
)
from common.record import RoundRecord, personalized_stats
from strategies.engine.accounting import RoundLedger
from strategies.engine.exchange import Exchange
from strategies.engine.identity import NodeDirectory
from strategies.engine.replies import ReplyCheck

Drawn = dict[int, str | None]
"""node -> client id (None: a node not identified yet)."""


def fused_evaluation(reply: ClientReply) -> ClientReply:
    """The evaluation a valid train reply carries, as an evaluate reply of the same client
    (``num-examples``: its test examples, ``accuracy``, ``task-accuracy`` when it carries
    ``eval-task-accuracy``, and ``eval-cpu-seconds``). Raises ``ReplyError`` if the
    ``eval-*`` metrics are missing or malformed (their ranges are checked with every metric,
    ``common.protocol.METRIC_RANGES``)."""
    accuracy = reply.metrics.get(EVAL_ACCURACY)
    examples = reply.metrics.get(EVAL_EXAMPLES)
    if not isinstance(accuracy, float) or not isinstance(examples, int) or examples <= 0:
        raise ReplyError(f"train reply lacks a valid {EVAL_ACCURACY}/{EVAL_EXAMPLES}")
    task = ({TASK_ACCURACY: float(reply.metrics[EVAL_TASK_ACCURACY])}
            if EVAL_TASK_ACCURACY in reply.metrics else {})
    return ClientReply(reply.node_id, reply.client_id, ArrayRecord(), MetricRecord(
        {NUM_EXAMPLES: examples, "accuracy": accuracy, **task,
         EVAL_CPU: float(reply.metrics.get(EVAL_CPU, 0.0))}), reply.info)


def scores_of(replies: list[ClientReply]) -> dict[str, tuple[float, int]]:
    """client id -> (accuracy, test examples) of valid evaluate replies."""
    return {r.client_id: (float(r.metrics["accuracy"]), r.num_examples) for r in replies}


def task_accuracies_of(replies: list[ClientReply]) -> dict[str, float]:
    """client id -> task accuracy of the valid evaluate replies that carry one (an optional
    metric, range-checked with every metric when the reply was validated)."""
    return {r.client_id: float(r.metrics[TASK_ACCURACY]) for r in replies
            if TASK_ACCURACY in r.metrics}


class PendingEvaluation:
    """The evaluation drawn and not yet asked, and every client's latest accuracy."""

    def __init__(self, settings: RunSettings, ledger: RoundLedger, replies: ReplyCheck) -> None:
        self.settings = settings
        self.ledger = ledger
        self.replies = replies
        self.per_client_accuracy: dict[str, float] = {}
        self.drawn: Drawn | None = None  # nodes drawn to evaluate the last round
        self._drawn_clients: set[str] | None = None  # the same, after a resume
        self.rejoined_at_evaluate: set[str] = set()  # their first score goes to ``rejoined``

    # ------------------------------------------------------------------ draw and carry
    def fraction(self, server_round: int) -> float:
        """The share of nodes that evaluate round ``server_round``: ``fraction-evaluate``,
        everyone after the last round."""
        last = server_round == self.settings.num_server_rounds
        return (1.0 if last and self.settings.fraction_evaluate > 0
                else self.settings.fraction_evaluate)

    def draw(self, clients: Drawn) -> None:
        self.drawn = clients

    def take(self) -> Drawn | None:
        """The drawn clients, now to be asked (None: none drawn)."""
        drawn, self.drawn = self.drawn, None
        return drawn

    # ------------------------------------------------------------------ replies and record
    def split_off(self, server_round: int, train: Exchange, evaluate: Exchange,
                  evaluators: set[int]) -> None:
        """Round ``server_round``'s evaluation out of the next round's exchange: the evaluate
        replies, and the ``eval-*`` metrics of the evaluators' train replies, validated on
        their own like any reply (envelope, identity, metrics; the arrays are the train
        stage's business: a train reply dropped for its arrays still counts for the
        evaluation, as it would in the two-exchange protocol)."""
        valid = self.replies.valid(server_round, "evaluate", evaluate, EVALUATE_METRICS)
        evaluating = Exchange([m for m in train.sent if m.metadata.dst_node_id in evaluators],
                              [(n, r) for n, r in train.replies if n in evaluators])
        fused = []
        for reply in self.replies.valid_envelopes(server_round, "evaluate", evaluating,
                                                  (EVAL_ACCURACY, EVAL_EXAMPLES)):
            try:
                fused.append(fused_evaluation(reply))
            except ReplyError as reason:
                self.ledger.drop(server_round, "evaluate", reply.node_id, reply.client_id,
                                 str(reason))
        fused = self.replies.example_counts.bound("evaluate", fused)  # their test examples
        self.ledger.client_cpu(server_round, "evaluate", valid)
        self.ledger.client_cpu(server_round, "evaluate", fused, cpu_metric=EVAL_CPU)
        scores = scores_of(valid + fused)
        self.record(server_round, dict(sorted(scores.items(),
                                              key=lambda kv: client_order(kv[0]))),
                    task_accuracies_of(valid + fused))

    def record(self, server_round: int, scores: dict[str, tuple[float, int]],
               task_accuracy: dict[str, float] | None = None) -> None:
        """Round ``server_round``'s personalized statistics from ``scores`` (client id ->
        (accuracy, test examples)) and ``task_accuracy`` (client id -> task accuracy, of the
        clients that sent one: ``accuracy_task_mean``); rejoined clients' first scores go to
        ``rejoined``."""
        rejoined = {c: a for c, (a, _) in scores.items() if c in self.rejoined_at_evaluate}
        if rejoined:
            self.record_rejoined(server_round, rejoined)
            self.rejoined_at_evaluate.difference_update(rejoined)
        if not scores:
            return
        stats = personalized_stats(scores, task_accuracy)
        self.ledger.record(server_round).eval = stats
        self.per_client_accuracy.update(stats["per_client"])

    def record_rejoined(self, server_round: int, scores: dict[str, float]) -> None:
        """The first accuracy of clients that came back on a new node (``rejoined``)."""
        self.ledger.record(server_round).extra.setdefault("rejoined", {}).update(scores)
        for client_id, accuracy in scores.items():
            log(INFO, "round %d: client %s rejoined (new node); accuracy before training "
                "again %.4f (last before: %s)", server_round, client_id, accuracy,
                self.per_client_accuracy.get(client_id))

    # ------------------------------------------------------------------ checkpoint
    def state(self, server_round: int) -> dict[str, Any] | None:
        """What a resumed run needs of an evaluation still to come: the round, its record so
        far, and the client ids drawn for it."""
        if self.drawn is None:
            return None
        clients = [c for c in self.drawn.values() if c is not None]
        if len(clients) < len(self.drawn):
            log(WARNING, "checkpoint: %d nodes drawn for evaluation have no client id yet",
                len(self.drawn) - len(clients))
        return {"round": server_round, "clients": clients,
                "record": asdict(self.ledger.record(server_round))}

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is None:
            return
        self.ledger.history[state["round"]] = RoundRecord(**state["record"])
        self._drawn_clients = set(state["clients"])

    def resolve(self, nodes: NodeDirectory) -> None:
        """After a resume: the drawn clients' current nodes (identified at the start)."""
        if self._drawn_clients is not None:
            self.drawn = {n: nodes.client_of(n) for n in nodes.nodes_of(self._drawn_clients)}
            self._drawn_clients = None
