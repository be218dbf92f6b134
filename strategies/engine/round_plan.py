"""One round's plan, and the one pass that reads its exchange's replies.

A round's exchange can carry two jobs: training round ``r``, and (fused evaluation) the
evaluation of round ``r - 1`` by the clients drawn for it at the end of that round
(``evaluation.PendingEvaluation``). The ``RoundPlan`` fixes both before anything is sent:
who trains, who evaluates, and which round they evaluate. ``read_round`` then reads every
reply once (its envelope; the client id its node claims, only when the reply serves a job)
and splits it into the jobs it serves: a train update (its arrays checked against the wire
spec) and an evaluation (the ``eval-*`` metrics a train reply carries, or an evaluate
reply). A reply is dropped for each job it fails, under that job's round and stage: a train
reply dropped for its arrays still counts for the evaluation, as it would in the
two-exchange protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from flwr.app import ArrayRecord, MessageType, MetricRecord

from common.protocol import (
    EVAL_ACCURACY,
    EVAL_CPU,
    EVAL_EXAMPLES,
    EVAL_TASK_ACCURACY,
    EXACT_EVALUATION,
    NUM_EXAMPLES,
    TASK_ACCURACY,
    ArraySpec,
    ClientReply,
    ReplyError,
    evaluate_metric_keys,
    parse_reply,
    require_metrics,
    train_metric_keys,
)
from strategies.engine.accounting import RoundLedger
from strategies.engine.exchange import Exchange
from strategies.engine.replies import (
    ReplyCheck,
    admitted,
    note_presence,
    read_or_error,
    reason_of,
    with_checked_arrays,
)
from strategies.engine.sampling import Draw, Drawn


@dataclass(frozen=True)
class RoundPlan:
    """Who round ``round``'s exchange asks for what, fixed before anything is sent."""

    round: int
    trainers: Drawn
    """The nodes that train round ``round``."""
    evaluators: Drawn
    """The nodes that evaluate round ``evaluated``: a trainer first, within its train
    message (fused evaluation), any other with an evaluate message."""
    evaluated: int | None
    """The round whose evaluation this exchange completes (None: no evaluation was
    pending: the two-exchange protocol, the run's first round, or after a finished run)."""
    eligible: int = 0
    """How many nodes the trainers were drawn from (0: as many as were drawn)."""

    def draw(self) -> Draw:
        """The trainers' draw as the privacy accountant counts it (``PrivacyLedger``)."""
        return Draw.of(self.trainers, self.eligible)

    def evaluating_trainers(self) -> set[int]:
        """The trainers that evaluate first (the fused-evaluation flag of their message)."""
        return set(self.evaluators) & set(self.trainers)

    def evaluating_only(self) -> Drawn:
        """The evaluators that do not train this round: an evaluate message each."""
        return {n: c for n, c in self.evaluators.items() if n not in self.trainers}


@dataclass(frozen=True)
class RoundReplies:
    """What one round's exchange brought, read once (``read_round``)."""

    updates: list[ClientReply]
    """The valid train replies, in client order, their arrays checked."""
    evaluations: list[ClientReply]
    """The valid evaluate replies of round ``plan.evaluated``."""
    fused_evaluations: list[ClientReply]
    """The valid evaluations that train replies carried, as evaluate replies."""


@dataclass(frozen=True)
class RoundOutcome:
    """What a round's train exchange changed (``RoundEngine.train_round``)."""

    arrays: ArrayRecord | None
    """The new shared arrays (None: no valid reply, the shared model stays as it was)."""
    completed: tuple[int, ...]
    """The rounds whose records the exchange completed, in order: the round whose
    evaluation came with it, then (fused evaluation) this round when it is not evaluated
    (``evaluate-every``): results.json can show them."""


def fused_evaluation(reply: ClientReply) -> ClientReply:
    """The evaluation a train reply carries, as an evaluate reply of the same client
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
    exact = ({EXACT_EVALUATION: 1.0} if EXACT_EVALUATION in reply.metrics else {})
    return ClientReply(reply.node_id, reply.client_id, ArrayRecord(), MetricRecord(
        {NUM_EXAMPLES: examples, "accuracy": accuracy, **task, **exact,
         EVAL_CPU: float(reply.metrics.get(EVAL_CPU, 0.0))}), reply.info)


def train_update(reply: ClientReply, expected_arrays: Callable[[ClientReply], ArraySpec],
                 metric_keys: tuple[str, ...]) -> ClientReply:
    """The train update a reply carries: its train metrics (``metric_keys``:
    ``common.protocol.train_metric_keys``) present, its arrays checked
    (``replies.with_checked_arrays``). Raises on the first fault."""
    require_metrics(reply.metrics, metric_keys)
    return with_checked_arrays(reply, expected_arrays)


def read_round(check: ReplyCheck, plan: RoundPlan, batch: Exchange,
               expected_arrays: Callable[[ClientReply], ArraySpec]) -> RoundReplies:
    """Every reply of ``batch`` (the exchange ``plan`` sent) read once, in order: the evaluate
    replies; who replied to a train message (a missing node dropped from each of its jobs);
    each train reply's envelope, then its train update and (an evaluator's) its evaluation;
    the client id it claims (``admitted``), heard only from a reply that serves a job: one
    that serves none is dropped from each job with that job's own reason and binds nothing;
    then each job an admitted reply failed, dropped on its own. Example counts are bounded
    by each client's first report (``robust.ExampleCounts``)."""
    parts = batch.by_type()
    train = parts[MessageType.TRAIN]
    ledger, nodes, settings = check.ledger, check.nodes, check.settings
    evaluations = (check.valid(plan.evaluated, "evaluate", parts[MessageType.EVALUATE],
                               evaluate_metric_keys(settings.dp_mode))
                   if plan.evaluating_only() else [])

    def drop_jobs(node_id: int, client_id: str, reason: str) -> None:
        ledger.drop(plan.round, "train", node_id, client_id, reason)
        if node_id in plan.evaluators:
            ledger.drop(plan.evaluated, "evaluate", node_id, client_id, reason)

    note_presence(ledger, nodes, plan.round, train, settings.round_timeout, drop_jobs)
    read, jobs = [], {}
    for node_id, reply in train.replies:
        envelope = read_or_error(partial(parse_reply, node_id, reply, (),
                                         settings.max_num_examples))
        if isinstance(envelope, ClientReply):
            update = read_or_error(partial(train_update, envelope, expected_arrays,
                                           train_metric_keys(settings.dp_mode)))
            evaluation = (read_or_error(partial(fused_evaluation, envelope))
                          if node_id in plan.evaluators else None)
            if not isinstance(update, ClientReply) and not isinstance(evaluation, ClientReply):
                _drop_failed(ledger, plan, node_id, nodes.client_of(node_id)
                             or envelope.client_id, update, evaluation)
                continue
            jobs[node_id] = (update, evaluation)
        read.append((node_id, reply, envelope))
    updates, fused = [], []
    for reply in admitted(nodes, plan.round, read, drop_jobs):
        update, evaluation = jobs[reply.node_id]
        if isinstance(update, ClientReply):
            updates.append(update)
        if isinstance(evaluation, ClientReply):
            fused.append(evaluation)
        _drop_failed(ledger, plan, reply.node_id, reply.client_id, update, evaluation)
    return RoundReplies(check.example_counts.bound("train", updates), evaluations,
                        check.example_counts.bound("evaluate", fused))


def _drop_failed(ledger: RoundLedger, plan: RoundPlan, node_id: int, client_id: str,
                 update: ClientReply | Exception, evaluation: ClientReply | Exception | None
                 ) -> None:
    """Each job a reply failed, dropped under its round and stage with its own reason."""
    if isinstance(update, Exception):
        ledger.drop(plan.round, "train", node_id, client_id, reason_of(update))
    if isinstance(evaluation, Exception):
        ledger.drop(plan.evaluated, "evaluate", node_id, client_id, reason_of(evaluation))
