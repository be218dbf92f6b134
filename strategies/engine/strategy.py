"""``Strategy``: the round engine every method runs on (contracts §3-§5), FedAvg's rule by
default.

A round, as ``train_round`` runs it (the ServerApp's loop, with checkpoints, is
``server_app/rounds.py``):

1. **expire** client ids not heard from for ``identity.expire-rounds``; ``begin_round`` hook;
2. **admit and sample**: wait for ``min-nodes``, identify newcomers (``Admission``: identify
   queries, a rejoining client's evaluation), then draw a ``fraction-train`` share;
3. **address**: one message per node with its own ``downlink`` (``Messenger``); with fused
   evaluation the clients drawn at the end of the last round evaluate first;
4. **exchange**: send and wait (``round-timeout``, ``max-in-flight``);
5. **validate** each reply against the wire spec (``ReplyCheck``; a reply that fails is
   dropped with its reason); split off the last round's evaluation (``PendingEvaluation``);
   stop the run if every reply failed the same way;
6. **aggregate** (``aggregate_train`` hook) and record the round (``RoundLedger``: bytes,
   CPU, drops, loss);
7. **draw** the clients that evaluate this round (fused evaluation: asked next round).

The collaborators are built here and passed to each other; the hooks a method may override
are ``hooks.MethodHooks``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any, Generic

from flwr.app import ArrayRecord, MessageType
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import MethodSettingsT, RunSettings
from common.protocol import (
    EVALUATE_METRICS,
    TRAIN_METRICS,
    ArraySpec,
    ClientReply,
)
from strategies.engine.accounting import RoundLedger
from strategies.engine.admission import Admission
from strategies.engine.evaluation import (
    Drawn,
    PendingEvaluation,
    scores_of,
    task_accuracies_of,
)
from strategies.engine.exchange import Messenger
from strategies.engine.identity import NodeDirectory
from strategies.engine.replies import ReplyCheck, stop_if_every_reply_failed
from strategies.engine.robust import ExampleCounts, aggregate
from strategies.wire import Masks, WireSpec


class Strategy(Generic[MethodSettingsT]):
    """Example-weighted mean of a method's shared parameters, with per-node messages,
    validation, client identity and accounting."""

    checkpointed: tuple[str, ...] = ()
    client_tables: tuple[str, ...] = ()

    def __init__(self, settings: RunSettings[MethodSettingsT], initial_arrays: ArrayRecord,
                 wire: WireSpec[MethodSettingsT]) -> None:
        self.settings = settings
        self.wire = wire
        self.global_arrays = initial_arrays  # the shared arrays the current round started from
        self.ledger = RoundLedger()
        self.nodes = NodeDirectory(settings)
        self.example_counts = ExampleCounts()
        self.replies = ReplyCheck(settings, self.ledger, self.nodes, self.example_counts)
        self.messenger = Messenger(settings, self.ledger, self.downlink)
        self.evaluation = PendingEvaluation(settings, self.ledger, self.replies)
        self.admission = Admission(settings, self.nodes, self.messenger, self.replies,
                                   self.ledger, self.evaluation, self.on_identified)

    # ------------------------------------------------------------------ hooks (hooks.py)
    def begin_round(self, server_round: int) -> None:
        return None

    def on_identified(self, client_id: str, info: dict[str, Any]) -> None:
        return None

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        return arrays

    def uplink_masks(self) -> Masks | None:
        return None

    def aggregate_train(self, server_round: int, replies: list[ClientReply],
                        arrays: ArrayRecord) -> ArrayRecord:
        return self.aggregate_keys(replies, list(arrays.keys()), arrays)

    def after_training(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        return None

    def client_tables_changed(self) -> None:
        return None

    def state_tables(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ for the hooks
    def aggregate_keys(self, replies: list[ClientReply], keys: list[str],
                       reference: ArrayRecord, uniform: bool = False) -> ArrayRecord:
        """``keys`` of the replies' arrays by the run's ``aggregation.*`` rule (``reference``:
        the arrays the round started from, for update clipping; ``uniform``: the mean counts
        every client once instead of by examples)."""
        return aggregate(replies, keys, reference, self.settings, uniform)

    def report(self, server_round: int, name: str, value: Any) -> None:
        """A per-round value of the method, shown in that round's entry of results.json."""
        self.ledger.report(server_round, name, value)

    # ------------------------------------------------------------------ the run
    def identify(self, grid: Grid, first_round: int = 1) -> None:
        """The preflight before ``first_round`` (``Admission.identify_all``); after a resume,
        the nodes of the clients drawn to evaluate the checkpoint's round."""
        self.admission.identify_all(grid, first_round)
        self.evaluation.resolve(self.nodes)

    def train_round(self, grid: Grid, server_round: int, arrays: ArrayRecord
                    ) -> ArrayRecord | None:
        """One round, stages in order (module docstring); the new shared arrays (None: no
        valid reply, the shared model stays as it was)."""
        previous = server_round - 1
        with self.ledger.server_cpu(server_round):
            self.forget_expired(server_round)
            self.begin_round(server_round)
            trainers = self.admit_and_sample(grid, server_round, arrays,
                                             self.settings.fraction_train, MessageType.TRAIN)
            evaluators = self.evaluation.take() or {}
            messages = self.messenger.address(server_round, trainers, arrays,
                                              MessageType.TRAIN, server_round,
                                              evaluate_first=set(evaluators))
            messages += self.messenger.address(
                previous, {n: c for n, c in evaluators.items() if n not in trainers}, arrays,
                MessageType.EVALUATE, previous)
            self.global_arrays = arrays
        batch = self.messenger.send(grid, messages)
        with self.ledger.server_cpu(server_round):
            parts = batch.by_type()
            valid = self.replies.valid(server_round, "train", parts[MessageType.TRAIN],
                                       TRAIN_METRICS, self.uplink_expected())
            self.ledger.client_cpu(server_round, "train", valid)
            if evaluators:
                self.evaluation.split_off(previous, parts[MessageType.TRAIN],
                                          parts[MessageType.EVALUATE], set(evaluators))
            stop_if_every_reply_failed(f"training of round {server_round}", server_round,
                                       batch, self.settings.min_nodes)
            updated = self.aggregate(server_round, valid)
        if self.settings.fused_evaluation:
            with self.ledger.server_cpu(server_round):
                self.evaluation.draw(self.admit_and_sample(
                    grid, server_round, arrays if updated is None else updated,
                    self.evaluation.fraction(server_round), MessageType.EVALUATE))
        return updated

    def evaluate_round(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> None:
        """The evaluate exchange of round ``server_round`` (the two-exchange protocol, and
        the last round of the fused one: then with the clients drawn at its end)."""
        with self.ledger.server_cpu(server_round):
            clients = self.evaluation.take()
            if clients is None:
                clients = self.admit_and_sample(grid, server_round, arrays,
                                                self.evaluation.fraction(server_round),
                                                MessageType.EVALUATE)
            messages = self.messenger.address(server_round, clients, arrays,
                                              MessageType.EVALUATE, server_round)
        batch = self.messenger.send(grid, messages)
        with self.ledger.server_cpu(server_round):
            valid = self.replies.valid(server_round, "evaluate", batch, EVALUATE_METRICS)
            stop_if_every_reply_failed(f"evaluation of round {server_round}", server_round,
                                       batch, self.settings.min_nodes)
            self.ledger.client_cpu(server_round, "evaluate", valid)
            self.evaluation.record(server_round, scores_of(valid), task_accuracies_of(valid))

    # ------------------------------------------------------------------ stages
    def forget_expired(self, server_round: int) -> None:
        """Drop the per-client tables of client ids not heard from for
        ``identity.expire-rounds`` rounds."""
        expired = self.nodes.expire(server_round)
        for client_id in expired:
            self.evaluation.per_client_accuracy.pop(client_id, None)
            for name in self.client_tables:
                getattr(self, name).pop(client_id, None)
            self.example_counts.pinned.pop(client_id, None)
            log(INFO, "round %d: client id %s expired (not heard from for %d rounds)",
                server_round, client_id, self.settings.expire_rounds)
        if expired:
            self.client_tables_changed()

    def admit_and_sample(self, grid: Grid, server_round: int, arrays: ArrayRecord,
                         fraction: float, stage: str) -> Drawn:
        """A ``fraction`` of the samplable nodes (node -> client id), after the nodes that
        connected since the last exchange were identified (which sends identify queries,
        and at training a rejoining client's evaluation: ``Admission.identify_newcomers``)."""
        if fraction == 0.0:
            return {}
        nodes = self.admission.connected(grid)
        self.admission.identify_newcomers(grid, server_round, stage, nodes, arrays)
        eligible = self.nodes.samplable(nodes)
        node_ids = random.sample(eligible, min(len(eligible),
                                               max(int(len(eligible) * fraction), 1)))
        return {n: self.nodes.client_of(n) for n in node_ids}

    def uplink_expected(self) -> Callable[[ClientReply], ArraySpec]:
        """What a train reply must carry: the wire spec's uplink, cut by this round's masks."""
        masks = self.uplink_masks()
        return lambda reply: self.wire.uplink_spec(reply.info, masks)

    def aggregate(self, server_round: int, valid: list[ClientReply]) -> ArrayRecord | None:
        """The ``aggregate_train`` hook over the valid replies, and the round's train loss."""
        if not valid:
            log(WARNING, "round %d: no valid train reply; the shared model is unchanged",
                server_round)
            return None
        updated = self.aggregate_train(server_round, valid, self.global_arrays)
        total = sum(r.num_examples for r in valid)
        loss = sum(float(r.metrics["train-loss"]) * r.num_examples for r in valid) / total
        self.ledger.record(server_round).train = {"loss": loss, "num_clients": len(valid)}
        return updated

    # ------------------------------------------------------------------ checkpoint
    def checkpoint_state(self) -> dict[str, Any]:
        """Everything this strategy needs to continue a run: every client's latest accuracy,
        the method's ``checkpointed`` attributes, when each client id was last heard from and
        the pinned example counts."""
        return {"per_client_accuracy": self.evaluation.per_client_accuracy,
                **{name: getattr(self, name) for name in self.checkpointed},
                "last_seen": self.nodes.last_seen,
                "example_counts": self.example_counts.pinned}

    def restore_state(self, state: dict[str, Any]) -> None:
        self.evaluation.per_client_accuracy = dict(state["per_client_accuracy"])
        for name in self.checkpointed:
            setattr(self, name, state[name])
        self.nodes.last_seen = dict(state.get("last_seen", {}))
        self.example_counts.pinned = dict(state.get("example_counts", {}))
        self.client_tables_changed()
