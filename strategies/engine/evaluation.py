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

With ``evaluate-every = k`` only every k-th round and the last ``EVALUATED_LAST_ROUNDS`` are
evaluated; ``E_r`` of the others is drawn and not asked (unless the run stops after round
``r``: a DP budget stop), and their records are complete once they trained. Evaluation
changes nothing a client trains (it evaluates a copy, or before its training is seeded), so
the evaluated rounds' numbers are those of a run that evaluates every round.

``PendingEvaluation`` owns round ``r``'s evaluation from the draw to the record: ``draw``
(at the end of round ``r``), ``take`` (round ``r + 1``'s plan carries it,
``round_plan.RoundPlan``, or the evaluate exchange sends it), ``record_replies`` (the
replies, read with round ``r + 1``'s by ``round_plan.read_round``, or the evaluate
exchange's; round ``r``'s record is then complete: one round late with fused evaluation),
and ``state`` / ``restore`` / ``resolve`` (a checkpoint taken between the draw and the
exchange). It also keeps every client's latest accuracy (``forget``: an expired client id)
and the clients found rejoining at an evaluate exchange (``expect_rejoined``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict
from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log

from common.config import EVALUATED_LAST_ROUNDS, RunSettings
from common.protocol import EVAL_CPU, TASK_ACCURACY, ClientReply, client_order
from common.record import RoundRecord, personalized_stats
from strategies.engine.accounting import RoundLedger
from strategies.engine.identity import NodeDirectory
from strategies.engine.sampling import Drawn


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

    def __init__(self, settings: RunSettings, ledger: RoundLedger) -> None:
        self.settings = settings
        self.ledger = ledger
        self.per_client_accuracy: dict[str, float] = {}
        self.drawn: Drawn | None = None  # nodes drawn to evaluate the last round
        self.asked = True  # whether they are asked: False where evaluate-every skips the round
        self._drawn_clients: set[str] | None = None  # the same, after a resume
        self.rejoined_at_evaluate: set[str] = set()  # their first score goes to ``rejoined``

    def expect_rejoined(self, client_ids: Iterable[str]) -> None:
        """Clients found rejoining (on a new node) at an evaluate exchange's admission: their
        first score goes to ``rejoined``."""
        self.rejoined_at_evaluate.update(client_ids)

    def forget(self, client_id: str) -> None:
        """An expired client id."""
        self.per_client_accuracy.pop(client_id, None)

    # ------------------------------------------------------------------ draw and carry
    def fraction(self, server_round: int) -> float:
        """The share of nodes that evaluate round ``server_round``: ``fraction-evaluate``,
        everyone after the last round."""
        last = server_round == self.settings.num_server_rounds
        return (1.0 if last and self.settings.fraction_evaluate > 0
                else self.settings.fraction_evaluate)

    def evaluates(self, server_round: int) -> bool:
        """Whether round ``server_round`` is evaluated: every ``evaluate-every``-th round,
        and each of the last ``EVALUATED_LAST_ROUNDS`` (those a comparison's figures read).
        A round that is not is sampled for evaluation all the same (``RoundEngine``): the
        run's draws, and so its trainers, are those of a run that evaluates every round."""
        return (server_round % self.settings.evaluate_every == 0
                or server_round > self.settings.num_server_rounds - EVALUATED_LAST_ROUNDS)

    def draw(self, clients: Drawn, asked: bool = True) -> None:
        """The clients drawn to evaluate the round just trained; ``asked`` False: a round
        ``evaluate-every`` skips, whose clients are asked only if the run ends after it
        (``take(last=True)``: a DP budget stop)."""
        self.drawn, self.asked = clients, asked
        if not asked:  # a rejoin found at its admission is not evaluated before it trains
            self.rejoined_at_evaluate.difference_update(clients.values())

    def take(self, last: bool = False) -> Drawn | None:
        """The drawn clients, now to be asked (None: none drawn, or drawn for a skipped round
        and this is not the run's ``last`` evaluation); nothing is pending after."""
        drawn, self.drawn = self.drawn, None
        return drawn if self.asked or last else None

    # ------------------------------------------------------------------ replies and record
    def record_replies(self, server_round: int, evaluations: list[ClientReply],
                       fused: Sequence[ClientReply] = ()) -> None:
        """Round ``server_round``'s evaluation from its valid evaluate replies and the valid
        evaluations train replies carried (``round_plan.fused_evaluation``): the clients' CPU
        time, then the statistics (``record``), in client order."""
        self.ledger.client_cpu(server_round, "evaluate", evaluations)
        self.ledger.client_cpu(server_round, "evaluate", fused, cpu_metric=EVAL_CPU)
        replies = sorted([*evaluations, *fused], key=lambda r: client_order(r.client_id))
        self.record(server_round, scores_of(replies), task_accuracies_of(replies))

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
        self.ledger.record_eval(server_round, stats)
        self.per_client_accuracy.update(stats["per_client"])

    def record_rejoined(self, server_round: int, scores: dict[str, float]) -> None:
        """The first accuracy of clients that came back on a new node (``rejoined``)."""
        self.ledger.record_rejoined(server_round, scores)
        for client_id, accuracy in scores.items():
            log(INFO, "round %d: client %s rejoined (new node); accuracy before training "
                "again %.4f (last before: %s)", server_round, client_id, accuracy,
                self.per_client_accuracy.get(client_id))

    # ------------------------------------------------------------------ checkpoint
    def state(self, server_round: int) -> dict[str, Any]:
        """What a resumed run needs: every client's latest accuracy, and (``pending``) of an
        evaluation still to come its round, its record so far and the client ids drawn for
        it (None: none)."""
        return {"per_client_accuracy": self.per_client_accuracy,
                "pending": self._pending_state(server_round)}

    def _pending_state(self, server_round: int) -> dict[str, Any] | None:
        if self.drawn is None:
            return None
        clients = [c for c in self.drawn.values() if c is not None]
        if len(clients) < len(self.drawn):
            log(WARNING, "checkpoint: %d nodes drawn for evaluation have no client id yet",
                len(self.drawn) - len(clients))
        return {"round": server_round, "clients": clients, "asked": self.asked,
                "record": asdict(self.ledger.record(server_round))}

    def restore(self, state: dict[str, Any]) -> None:
        self.per_client_accuracy = dict(state.get("per_client_accuracy", {}))
        pending = state.get("pending")
        if pending is None:
            return
        self.ledger.restore_round(pending["round"], RoundRecord(**pending["record"]))
        self._drawn_clients = set(pending["clients"])
        self.asked = pending.get("asked", True)

    def resolve(self, nodes: NodeDirectory) -> None:
        """After a resume: the drawn clients' current nodes (identified at the start)."""
        if self._drawn_clients is not None:
            self.drawn = {n: nodes.client_of(n) for n in nodes.nodes_of(self._drawn_clients)}
            self._drawn_clients = None
