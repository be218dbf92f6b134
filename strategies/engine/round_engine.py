"""``RoundEngine``: the rounds every method runs (contracts §3-§5), holding the method's
server rule (``rule.MethodRule``).

A round, as ``plan_round`` (stages 1-2) and ``train_round`` (3-7) run it (the ServerApp's
loop, with checkpoints, is ``server_app/rounds.py``; it calls ``run_round``: ``train_round``,
then in the two-exchange protocol the round's evaluate exchange):

1. **expire** client ids not heard from for ``identity.expire-rounds`` (each collaborator's
   ``forget``);
2. **plan**: wait for ``min-nodes``, identify newcomers (``Admission``: identify queries, a
   rejoining client's evaluation), draw a ``fraction-train`` share (``sampling.Sampler``: a
   secret draw under central DP), and take the evaluation drawn at the end of the last
   round: a ``round_plan.RoundPlan`` (who trains, who evaluates which round, and the draw
   the privacy accountant counts, checked against the budget here);
3. **address**: one message per node with its own ``downlink`` (``Messenger``); with fused
   evaluation the plan's evaluators that train evaluate first, the others get an evaluate
   message in the same exchange;
4. **exchange**: send and wait (``round-timeout``, ``max-in-flight``);
5. **read** every reply once (``round_plan.read_round``): its envelope, then its train
   update (arrays against the wire spec) and its evaluation, then the client id it claims
   (heard only from a reply that serves a job), each job dropped with its reason on its own
   fault; record the evaluated round's scores (``PendingEvaluation``: that
   round's record is now complete); stop the run if every reply failed the same way;
6. **merge** (the rule's ``merge_updates``; under central DP its mean is the noised one of
   ``PrivacyLedger.merge`` over the plan's draw, which returns its clipping) and record the
   round (``RoundLedger``: bytes, CPU, drops, loss; ``PrivacyLedger.account`` of the plan's
   draw and the merge's clipping: the privacy spent); stop the run if training diverged
   everywhere (``DivergenceWatch``);
7. **draw** the clients that evaluate this round (fused evaluation: asked next round; a round
   that ``evaluate-every`` skips is drawn for and not asked).

The engine builds its collaborators and passes them to each other; the rule sees the run
through a ``RuleContext``. No collaborator changes another's attributes (a test walks these
modules): what a later stage needs travels in the plan or comes back from the stage that
produced it, and each collaborator with state offers ``forget(client_id)`` and
``state()`` / ``restore(state)``, which the engine composes into the checkpoint's snapshot
(one key each: ``nodes``, ``evaluation``, ``example_counts``, ``rule``, ``privacy``,
``random``). What the ServerApp uses is the public face below the stages: the round's record,
the server state for results.json, the checkpoint snapshot and its restore, and the message
config.
"""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any, Generic

from flwr.app import ArrayRecord, MessageType
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import MethodSettingsT, RunSettings
from common.protocol import ArraySpec, ClientReply, evaluate_metric_keys
from common.record import RoundRecord
from strategies.engine.accounting import RoundLedger
from strategies.engine.admission import Admission
from strategies.engine.evaluation import PendingEvaluation
from strategies.engine.exchange import Exchange, Messenger
from strategies.engine.identity import NodeDirectory
from strategies.engine.privacy import PrivacyLedger
from strategies.engine.replies import DivergenceWatch, ReplyCheck, stop_if_every_reply_failed
from strategies.engine.robust import ExampleCounts
from strategies.engine.round_plan import RoundOutcome, RoundPlan, RoundReplies, read_round
from strategies.engine.rule import MethodRule, RuleContext
from strategies.engine.sampling import Draw, Drawn, Sampler
from strategies.wire import WireSpec


class RoundEngine(Generic[MethodSettingsT]):
    """The rounds of a run, with per-node messages, validation, client identity and
    accounting, merging what clients send by the method's ``rule``."""

    def __init__(self, settings: RunSettings[MethodSettingsT], wire: WireSpec[MethodSettingsT],
                 rule: Callable[[RuleContext[MethodSettingsT]], MethodRule[MethodSettingsT]]
                 = MethodRule) -> None:
        self.settings = settings
        self.wire = wire
        self.ledger = RoundLedger()
        self.nodes = NodeDirectory(settings)
        self.example_counts = ExampleCounts()
        self.privacy = PrivacyLedger(settings)
        self.sampler = Sampler(settings)
        self.replies = ReplyCheck(settings, self.ledger, self.nodes, self.example_counts)
        self.divergence = DivergenceWatch(settings.min_nodes)
        # the rule is built last (it needs the context), and reached through these two
        self.messenger = Messenger(settings, self.ledger,
                                   lambda *args: self.rule.downlink(*args))
        self.evaluation = PendingEvaluation(settings, self.ledger)
        self.admission = Admission(settings, self.nodes, self.messenger, self.replies,
                                   self.ledger, self.evaluation,
                                   lambda *args: self.rule.client_identified(*args),
                                   self.privacy)
        self.context = RuleContext(settings, wire, self.ledger, self.nodes, self.replies,
                                   self.messenger, self.privacy)
        self.rule = rule(self.context)

    # ------------------------------------------------------------------ public face
    def round_record(self, server_round: int) -> RoundRecord:
        """What the engine recorded of round ``server_round`` (empty if nothing)."""
        return self.ledger.history.get(server_round, RoundRecord())

    def server_state(self) -> dict[str, Any]:
        """The server's per-client tables for results.json (``server_state``)."""
        return {"node_to_client": {str(k): v for k, v in self.nodes.node_to_client.items()},
                **self.rule.results_tables()}

    def evaluation_pending(self) -> bool:
        """Whether clients were drawn to evaluate a round and not asked yet: the last round's
        (fused evaluation), or a round ``evaluate-every`` skipped; asked by a final evaluate
        exchange if the run ends there (none is pending after a finished run's last
        checkpoint)."""
        return self.evaluation.drawn is not None

    def set_message_config(self, config: dict[str, Any]) -> None:
        """Added to every train and evaluate message's config from now on (a resumed run's
        lineage: ``server_app/app.py``)."""
        self.messenger.set_message_config(config)

    # ------------------------------------------------------------------ the run
    def identify(self, grid: Grid, first_round: int = 1) -> None:
        """The preflight before ``first_round`` (``Admission.identify_all``); after a resume,
        the nodes of the clients drawn to evaluate the checkpoint's round."""
        self.admission.identify_all(grid, first_round)
        self.evaluation.resolve(self.nodes)
        self.privacy.fix_population(self.nodes.client_info)  # before round 1's budget check

    def plan_round(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> RoundPlan:
        """Stages 1-2 of round ``server_round`` (module docstring): who trains, and who
        evaluates which round (the evaluation drawn at the end of the last round). Raises
        ``BudgetSpentError`` (before any train message went out) when the round would spend
        more privacy than ``dp.target-epsilon``."""
        with self.ledger.server_cpu(server_round):
            self.forget_expired(server_round)
            eligible = self.admit(grid, server_round, arrays, MessageType.TRAIN)
            trainers = self.draw(eligible, self.settings.fraction_train)
            # raises BudgetSpentError past the target, the evaluation drawn still pending
            self.privacy.check_budget(Draw.of(trainers, len(eligible)))
            evaluators = self.evaluation.take()
            return RoundPlan(server_round, trainers, evaluators or {},
                             None if evaluators is None else server_round - 1, len(eligible))

    def run_round(self, grid: Grid, plan: RoundPlan, arrays: ArrayRecord) -> RoundOutcome:
        """``plan``'s round as the run's protocol has it: ``train_round``, then, with
        ``fused-evaluation = false``, the round's evaluate exchange (``evaluate_round``, of
        the arrays it produced); the new shared arrays, and every round whose record is now
        complete, in order."""
        outcome = self.train_round(grid, plan, arrays)
        if self.settings.fused_evaluation:
            return outcome
        evaluated = self.evaluate_round(grid, plan.round,
                                        arrays if outcome.arrays is None else outcome.arrays)
        return RoundOutcome(outcome.arrays, (*outcome.completed, evaluated))

    def train_round(self, grid: Grid, plan: RoundPlan, arrays: ArrayRecord) -> RoundOutcome:
        """Stages 3-7 of ``plan``'s round (module docstring): the new shared arrays, and the
        round whose record the exchange completed."""
        server_round = plan.round
        with self.ledger.server_cpu(server_round):
            messages = self.messenger.address(server_round, plan.trainers, arrays,
                                              MessageType.TRAIN,
                                              evaluate_first=plan.evaluating_trainers(),
                                              config=self.privacy.message_config())
            if plan.evaluated is not None:
                messages += self.messenger.address(plan.evaluated, plan.evaluating_only(),
                                                   arrays, MessageType.EVALUATE)
        batch = self.messenger.send(grid, messages)
        with self.ledger.server_cpu(server_round):
            replies = self.read(plan, batch)
            self.ledger.client_cpu(server_round, "train", replies.updates)
            if plan.evaluators:
                self.evaluation.record_replies(plan.evaluated, replies.evaluations,
                                               replies.fused_evaluations)
                self.privacy.scores_released([*replies.evaluations,
                                              *replies.fused_evaluations])
            stop_if_every_reply_failed(f"training of round {server_round}", server_round,
                                       batch, self.settings.min_nodes)
            updated, note = self.merge(plan, replies.updates, arrays)
            spent = self.privacy.account(plan.draw(), updated is not None, note)
            if spent is not None:
                self.ledger.report(server_round, "privacy", spent)
            self.divergence.after_round(server_round, self.ledger.record(server_round),
                                        len(replies.updates))
        completed = () if plan.evaluated is None else (plan.evaluated,)
        if self.settings.fused_evaluation:
            with self.ledger.server_cpu(server_round):
                drawn = self.admit_and_sample(
                    grid, server_round, arrays if updated is None else updated,
                    self.evaluation.fraction(server_round), MessageType.EVALUATE)
            asked = self.evaluation.evaluates(server_round)  # drawn all the same
            self.evaluation.draw(drawn, asked)
            if not asked:
                completed += (server_round,)
        return RoundOutcome(updated, completed)

    def evaluate_round(self, grid: Grid, server_round: int, arrays: ArrayRecord,
                       last: bool = False) -> int:
        """The evaluate exchange of round ``server_round`` (the two-exchange protocol, and
        the ``last`` evaluation of a run: then with the clients drawn at its end, even for a
        round ``evaluate-every`` skips); returns the round whose record it completed
        (``server_round``). A skipped round's clients are drawn and kept, not asked."""
        with self.ledger.server_cpu(server_round):
            clients = self.evaluation.take(last)
            if clients is None:
                clients = self.admit_and_sample(grid, server_round, arrays,
                                                self.evaluation.fraction(server_round),
                                                MessageType.EVALUATE)
            if not (last or self.evaluation.evaluates(server_round)):
                self.evaluation.draw(clients, asked=False)
                return server_round
            messages = self.messenger.address(server_round, clients, arrays,
                                              MessageType.EVALUATE)
        batch = self.messenger.send(grid, messages)
        with self.ledger.server_cpu(server_round):
            valid = self.replies.valid(server_round, "evaluate", batch,
                                       evaluate_metric_keys(self.settings.dp_mode))
            stop_if_every_reply_failed(f"evaluation of round {server_round}", server_round,
                                       batch, self.settings.min_nodes)
            self.evaluation.record_replies(server_round, valid)
            if self.privacy.scores_released(valid):  # this round's entry: with them
                self.ledger.report(server_round, "privacy", self.privacy.spent())
        return server_round

    # ------------------------------------------------------------------ stages
    def forget_expired(self, server_round: int) -> None:
        """Drop the per-client tables of client ids not heard from for
        ``identity.expire-rounds`` rounds."""
        expired = self.nodes.expire(server_round)  # the directory forgets them itself
        for client_id in expired:
            self.evaluation.forget(client_id)
            self.example_counts.forget(client_id)
            self.rule.forget(client_id)
            log(INFO, "round %d: client id %s expired (not heard from for %d rounds)",
                server_round, client_id, self.settings.expire_rounds)
        if expired:
            self.rule.tables_changed()

    def admit_and_sample(self, grid: Grid, server_round: int, arrays: ArrayRecord,
                         fraction: float, stage: str) -> Drawn:
        """A ``fraction`` of the samplable nodes (node -> client id), after the nodes that
        connected since the last exchange were identified (which sends identify queries,
        and at training a rejoining client's evaluation: ``Admission.identify_newcomers``)."""
        if fraction == 0.0:
            return {}
        return self.draw(self.admit(grid, server_round, arrays, stage), fraction)

    def admit(self, grid: Grid, server_round: int, arrays: ArrayRecord, stage: str
              ) -> list[int]:
        """The samplable nodes, after the nodes that connected since the last exchange were
        identified."""
        nodes = self.admission.connected(grid)
        self.admission.identify_newcomers(grid, server_round, stage, nodes, arrays)
        return self.nodes.samplable(nodes)

    def draw(self, eligible: list[int], fraction: float) -> Drawn:
        """A ``fraction`` of the ``eligible`` nodes (at least one), by the run's sampler."""
        return {n: self.nodes.client_of(n) for n in self.sampler.draw(eligible, fraction)}

    def read(self, plan: RoundPlan, batch: Exchange) -> RoundReplies:
        """The replies of ``plan``'s exchange, each read once (``round_plan.read_round``):
        train replies against the wire spec's uplink, cut by this round's rows."""
        return read_round(self.replies, plan, batch, self.uplink_expected())

    def uplink_expected(self) -> Callable[[ClientReply], ArraySpec]:
        """What a train reply must carry: the wire spec's uplink, cut by this round's rows."""
        masks = self.rule.uplink_rows()
        return lambda reply: self.wire.uplink_spec(reply.info, masks)

    def merge(self, plan: RoundPlan, valid: list[ClientReply], arrays: ArrayRecord
              ) -> tuple[ArrayRecord | None, dict[str, Any] | None]:
        """The rule's ``merge_updates`` over the valid replies and the arrays the round
        started from (under central DP over the clients ``plan`` drew), and the round's train
        loss; the new shared arrays (None: no valid reply) and the clipping of the central-DP
        merge (None: none)."""
        server_round = plan.round
        if not valid:
            log(WARNING, "round %d: no valid train reply; the shared model is unchanged",
                server_round)
            return None, None
        with self.context.merging(len(plan.trainers)) as notes:
            updated = self.rule.merge_updates(server_round, valid, arrays)
        train: dict[str, Any] = {"num_clients": len(valid)}
        if all("train-loss" in r.metrics for r in valid):  # withheld under local DP
            total = sum(r.num_examples for r in valid)
            train["loss"] = sum(float(r.metrics["train-loss"]) * r.num_examples
                                for r in valid) / total
        self.ledger.record_train(server_round, train)
        return updated, notes[-1] if notes else None

    def after_training(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        """The rule's work after the last round; what it returns goes into results.json."""
        return self.rule.after_last_round(grid, arrays)

    # ------------------------------------------------------------------ checkpoint
    def snapshot(self, server_round: int) -> dict[str, Any]:
        """Everything the engine needs to continue a run after ``server_round``, one key per
        collaborator's ``state()``: when each client id was last heard from (``nodes``),
        every client's latest accuracy and the evaluation drawn and not yet asked
        (``evaluation``), the pinned example counts (``example_counts``), the rule's own
        record (``rule``), the privacy spent (``privacy``, a DP run) and the sampler's state
        (``random``; a secret draw under central DP has none)."""
        sampler = self.sampler.state()
        return {"nodes": self.nodes.state(),
                "evaluation": self.evaluation.state(server_round),
                "example_counts": self.example_counts.state(),
                "rule": dict(self.rule.state()),
                **({} if sampler is None else {"random": sampler}),
                **({"privacy": self.privacy.state()} if self.privacy.mode else {})}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Continue from a ``snapshot`` (read back from a checkpoint; one of the layout
        before the ``rule`` key is read too)."""
        snapshot = _current_layout(snapshot)
        self.nodes.restore(snapshot["nodes"])
        self.evaluation.restore(snapshot["evaluation"])
        self.example_counts.restore(snapshot["example_counts"])
        self.rule.restore(snapshot["rule"])
        self.rule.tables_changed()
        self.privacy.restore(snapshot.get("privacy"))
        self.sampler.restore(snapshot.get("random"))


# the engine's own keys in the snapshot's one "strategy" dict, before each collaborator had
# its key (the rest of that dict was the rule's attributes, by name)
_ENGINE_KEYS_BEFORE = ("per_client_accuracy", "last_seen", "example_counts")


def _current_layout(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of the layout before (``strategy``, ``pending_evaluation``) as today's."""
    if "strategy" not in snapshot:
        return snapshot
    old = snapshot["strategy"]
    return {**snapshot,
            "nodes": {"last_seen": old.get("last_seen", {})},
            "evaluation": {"per_client_accuracy": old.get("per_client_accuracy", {}),
                           "pending": snapshot.get("pending_evaluation")},
            "example_counts": old.get("example_counts", {}),
            "rule": {k: v for k, v in old.items() if k not in _ENGINE_KEYS_BEFORE}}
