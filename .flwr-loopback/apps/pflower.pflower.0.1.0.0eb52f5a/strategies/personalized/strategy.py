"""``PersonalizedStrategy``: the server side every method shares (contracts §3-§5).

One round is ``train_round`` then ``evaluate_round`` (the ServerApp's loop, with checkpoints,
is in ``server_app/rounds.py``). Each builds one message per sampled node with that client's
own downlink, sends them, validates the replies (``replies.py``) against the method's wire spec,
and aggregates; node identity and rejoining clients are ``identity.py``'s, bytes, CPU time and
per-round records ``accounting.py``'s.

A method changes the server side only through these hooks (``strategies/<method>/server.py``):

- ``downlink(server_round, client_id, arrays)``: what one client receives (default: the shared
  arrays as they are);
- ``uplink_masks()``: row masks the clients' uplinks are cut to this round (default: none);
- ``aggregate_shared(server_round, replies, arrays)``: the new shared arrays from the valid
  train replies (default: the run's ``aggregation.*`` rule over all shared keys, ``robust.py``;
  a method that averages over clients itself uses ``aggregate_keys`` or ``robust.combine``);
- ``begin_round(server_round)``: before a round's train messages are built;
- ``on_identified(client_id, info)``: a node said who it is;
- ``after_training(grid, arrays)``: work after the last round, its result goes into
  results.json;
- ``state_tables()``: per-client tables shown under ``server_state`` in results.json;
- ``checkpointed``: the attributes saved in the checkpoint (a method adds its tables);
- ``client_tables``: those of them keyed by client id (forgotten when an id expires).

Per-round values go into results.json with ``report(server_round, name, value)``; run-level
ones (``after_training``'s) are returned. Messages to nodes outside the regular exchanges (a
method's queries) go through ``query``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import RunSettings
from common.protocol import (
    ARRAYS,
    CONFIG,
    EVAL_ACCURACY,
    EVAL_CPU,
    EVAL_EXAMPLES,
    EVALUATE_FIRST,
    EVALUATE_METRICS,
    SERVER_ROUND,
    TRAIN_METRICS,
    ArraySpec,
    ClientReply,
    client_order,
)
from strategies.personalized.accounting import RoundLedger
from strategies.personalized.admission import Admission
from strategies.personalized.evaluation import Evaluation, fused_evaluation
from strategies.personalized.identity import NodeDirectory, wait_for_nodes
from strategies.personalized.replies import (
    Exchange,
    ReplyError,
    exchange,
    stop_if_every_reply_failed,
    valid_replies,
)
from strategies.personalized.robust import ExampleCounts, aggregate
from strategies.wire import Masks, WireSpec


class PersonalizedStrategy(Admission, Evaluation):
    """Example-weighted mean of a method's shared parameters, with per-node messages,
    validation, client identity and accounting."""

    # Attributes saved in the server checkpoint and restored on resume; a method adds its
    # per-client tables (``(*PersonalizedStrategy.checkpointed, "split")``).
    checkpointed: tuple[str, ...] = ("per_client_accuracy",)
    # The checkpointed attributes keyed by client id: bounded like the node directory's
    # tables (``identity.max-clients``) and forgotten when a client id expires
    # (``identity.expire-rounds``). A method adds its own (``"branches"``).
    client_tables: tuple[str, ...] = ("per_client_accuracy",)

    def __init__(self, settings: RunSettings, initial_arrays: ArrayRecord,
                 wire: WireSpec) -> None:
        self.settings = settings
        self.wire = wire
        self.global_arrays = initial_arrays  # the shared arrays the current round started from
        self.ledger = RoundLedger()
        self.nodes = NodeDirectory(settings)
        self.example_counts = ExampleCounts()
        self.per_client_accuracy: dict[str, float] = {}
        # added to every train/evaluate message's config (resume lineage, see server_app)
        self.message_config: dict[str, Any] = {}
        self._rejoined_at_evaluate: set[str] = set()
        # nodes drawn to evaluate the last round, not yet asked (node -> client id)
        self.pending_evaluation: dict[int, str | None] | None = None
        self._pending_clients: set[str] | None = None  # the same, after a resume

    @property
    def shared_spec(self) -> ArraySpec:
        return self.wire.shared_spec

    @property
    def history(self) -> dict:
        return self.ledger.history

    # ------------------------------------------------------------------ method hooks
    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        """The arrays one client receives (``client_id`` None: a client not identified)."""
        return arrays

    def uplink_masks(self) -> Masks | None:
        """Row masks the clients' uplinks are cut to this round (None: whole tensors)."""
        return None

    def aggregate_shared(self, server_round: int, replies: list[ClientReply],
                         arrays: ArrayRecord) -> ArrayRecord:
        """New global shared arrays from the valid replies (default: the run's
        ``aggregation.*`` rule, ``robust.py``; by default the example-weighted mean)."""
        return self.aggregate_keys(replies, list(arrays.keys()), arrays)

    def begin_round(self, server_round: int) -> None:
        """Before the round's train messages are built."""

    def on_identified(self, client_id: str, info: dict[str, Any]) -> None:
        """A node told the server who it is (at the start or when it joins later)."""

    def after_training(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        """Work after the last round (e.g. FedFac's new-client evaluation)."""
        return None

    def state_tables(self) -> dict[str, Any]:
        """Server-side per-client tables, keyed by client id."""
        return {}

    # ------------------------------------------------------------------ helpers for methods
    def aggregate_keys(self, replies: list[ClientReply], keys: list[str],
                       reference: ArrayRecord, uniform: bool = False) -> ArrayRecord:
        """``keys`` of the replies' arrays by the run's ``aggregation.*`` rule (``reference``:
        the arrays the round started from, for update clipping; ``uniform``: the mean counts
        every client once instead of by examples)."""
        return aggregate(replies, keys, reference, self.settings, uniform)

    def report(self, server_round: int, name: str, value: Any) -> None:
        """A per-round value of the method, shown in that round's entry of results.json."""
        self.ledger.report(server_round, name, value)

    def query(self, grid: Grid, contents: dict[int, RecordDict]) -> Exchange:
        """One ``query`` message per node (``contents``: node -> content with an ``action``
        in its ``config`` record); the replies that arrived in time."""
        return exchange(grid, [Message(content, dst_node_id=node, message_type=MessageType.QUERY)
                               for node, content in contents.items()],
                        self.settings.round_timeout, self.settings.max_in_flight)

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything this strategy needs to continue a run: its ``checkpointed``
        attributes (NumPy arrays, ``ArrayRecord``s and JSON values: see
        ``common/durable.py``), when each client id was last heard from and the pinned
        example counts."""
        return {**{name: getattr(self, name) for name in self.checkpointed},
                "last_seen": self.nodes.last_seen,
                "example_counts": self.example_counts.pinned}

    def restore_state(self, state: dict[str, Any]) -> None:
        for name in self.checkpointed:
            setattr(self, name, state[name])
        self.nodes.last_seen = dict(state.get("last_seen", {}))
        self.example_counts.pinned = dict(state.get("example_counts", {}))

    def forget_expired(self, server_round: int) -> None:
        """Drop the per-client tables of client ids not heard from for
        ``identity.expire-rounds`` rounds."""
        for client_id in self.nodes.expire(server_round):
            for name in self.client_tables:
                getattr(self, name).pop(client_id, None)
            self.example_counts.pinned.pop(client_id, None)
            log(INFO, "round %d: client id %s expired (not heard from for %d rounds)",
                server_round, client_id, self.settings.expire_rounds)

    def connected_nodes(self, grid: Grid) -> list[int]:
        return wait_for_nodes(grid, self.nodes, self.settings.min_nodes,
                              self.settings.round_timeout)

    # ------------------------------------------------------------------ messages
    def _addressed(self, server_round: int, clients: dict[int, str | None], arrays: ArrayRecord,
                   message_type: str, config_round: int,
                   evaluate_first: set[int] | frozenset[int] = frozenset()) -> list[Message]:
        """One message per node (``clients``: node -> client id) with its own downlink, the
        run's ``message_config`` and ``server-round = config_round`` (and, for the nodes in
        ``evaluate_first``, the fused-evaluation flag); the arrays' bytes go into round
        ``server_round``'s downlink count."""
        messages = [Message(RecordDict({   # a fresh RecordDict per node: never shared
            ARRAYS: self.downlink(server_round, client_id, arrays),
            CONFIG: ConfigRecord({**self.message_config, SERVER_ROUND: config_round,
                                  **({EVALUATE_FIRST: True} if node_id in evaluate_first
                                     else {})}),
        }), dst_node_id=node_id, message_type=message_type, group_id=str(server_round))
            for node_id, client_id in clients.items()]
        self.ledger.downlink(server_round, messages)
        return messages

    def _pick(self, server_round: int, arrays: ArrayRecord, grid: Grid, fraction: float,
              message_type: str) -> dict[int, str | None]:
        """A ``fraction`` of the samplable nodes (newcomers identified first): node ->
        client id."""
        if fraction == 0.0:
            return {}
        nodes = self.connected_nodes(grid)
        self.admit_new_nodes(server_round, message_type, grid, nodes, arrays)
        eligible = self.nodes.samplable(nodes)
        node_ids = random.sample(eligible, min(len(eligible),
                                               max(int(len(eligible) * fraction), 1)))
        return {n: self.nodes.client_of(n) for n in node_ids}

    def send(self, grid: Grid, messages: list[Message]) -> Exchange:
        """One exchange; its wait goes into the round of its messages (``group_id``)."""
        started = time.perf_counter()
        batch = exchange(grid, messages, self.settings.round_timeout,
                         self.settings.max_in_flight)
        if messages:
            self.ledger.exchanged(int(messages[0].metadata.group_id),
                                  time.perf_counter() - started)
        return batch

    def validate(self, server_round: int, stage: str, batch: Exchange,
                 metric_keys: tuple[str, ...] | None,
                 expected_arrays: Callable[[ClientReply], ArraySpec] | None = None
                 ) -> list[ClientReply]:
        """The replies of ``batch`` that pass validation (``replies.valid_replies``, the one
        path for every exchange; ``metric_keys`` None: a query; ``expected_arrays`` None: the
        reply must carry no arrays), with train and evaluate example counts bounded by each
        client's first report (``robust.ExampleCounts``)."""
        valid = valid_replies(self.ledger, self.nodes, server_round, stage, batch,
                              metric_keys, self.settings.round_timeout, expected_arrays,
                              max_examples=self.settings.max_num_examples)
        if stage in ("train", "evaluate"):
            self.example_counts.bound(stage, valid)
        return valid

    def uplink_expected(self) -> Callable[[ClientReply], ArraySpec]:
        """What a train reply must carry: the wire spec's uplink, cut by this round's masks."""
        masks = self.uplink_masks()
        return lambda reply: self.wire.uplink_spec(reply.info, masks)

    # ------------------------------------------------------------------ rounds
    def train_round(self, grid: Grid, server_round: int, arrays: ArrayRecord
                    ) -> ArrayRecord | None:
        """Sample, send, validate, aggregate; the new shared arrays (None: no valid reply,
        the shared model stays as it was). With fused evaluation the same exchange carries
        the evaluation of the previous round (``evaluation.py``), and the clients that will
        evaluate this round are drawn at its end."""
        fused = self.settings.fused_evaluation
        with self.ledger.server_cpu(server_round):
            self.forget_expired(server_round)
            self.begin_round(server_round)
            trainers = self._pick(server_round, arrays, grid, self.settings.fraction_train,
                                  MessageType.TRAIN)
            evaluators, self.pending_evaluation = self.pending_evaluation or {}, None
            previous = server_round - 1
            messages = self._addressed(server_round, trainers, arrays, MessageType.TRAIN,
                                       server_round, evaluate_first=set(evaluators))
            evaluate_only = {n: c for n, c in evaluators.items() if n not in trainers}
            messages += self._addressed(previous, evaluate_only, arrays, MessageType.EVALUATE,
                                        previous)
            self.global_arrays = arrays
        batch = self.send(grid, messages)
        parts = batch.by_type()
        with self.ledger.server_cpu(server_round):
            valid = self.validate(server_round, "train", parts[MessageType.TRAIN],
                                  TRAIN_METRICS, self.uplink_expected())
            self.ledger.client_cpu(server_round, "train", valid)
            if evaluators:
                self._fused_evaluation(previous, parts[MessageType.TRAIN],
                                       parts[MessageType.EVALUATE], set(evaluators))
            stop_if_every_reply_failed(f"training of round {server_round}", server_round,
                                       batch, self.settings.min_nodes)
            updated = self._aggregate(server_round, valid)
        if fused:
            with self.ledger.server_cpu(server_round):
                self.draw_evaluation(grid, server_round,
                                     arrays if updated is None else updated)
        return updated

    def _fused_evaluation(self, server_round: int, train: Exchange, batch: Exchange,
                          evaluators: set[int]) -> None:
        """Round ``server_round``'s evaluation from this exchange: the evaluate replies, and
        the ``eval-*`` metrics of the evaluators' train replies, validated on their own like
        any reply (envelope, identity, metrics; the arrays are the train stage's business: a
        train reply dropped for its arrays still counts for the evaluation, as it would in the
        two-exchange protocol)."""
        valid = self.validate(server_round, "evaluate", batch, EVALUATE_METRICS)
        evaluating = Exchange([m for m in train.sent if m.metadata.dst_node_id in evaluators],
                              [(n, r) for n, r in train.replies if n in evaluators])
        fused = []
        for reply in valid_replies(self.ledger, self.nodes, server_round, "evaluate",
                                   evaluating, (EVAL_ACCURACY, EVAL_EXAMPLES),
                                   self.settings.round_timeout,
                                   max_examples=self.settings.max_num_examples,
                                   read_arrays=False):
            try:
                fused.append(fused_evaluation(reply))
            except ReplyError as reason:
                self.ledger.drop(server_round, "evaluate", reply.node_id, reply.client_id,
                                 str(reason))
        self.example_counts.bound("evaluate", fused)  # their test examples
        self.ledger.client_cpu(server_round, "evaluate", valid)
        self.ledger.client_cpu(server_round, "evaluate", fused, cpu_metric=EVAL_CPU)
        scores = self.scores_of(valid + fused)
        self.record_evaluation(server_round, dict(sorted(
            scores.items(), key=lambda kv: client_order(kv[0]))))

    def _aggregate(self, server_round: int, valid: list[ClientReply]) -> ArrayRecord | None:
        if not valid:
            log(WARNING, "round %d: no valid train reply; the shared model is unchanged",
                server_round)
            return None
        updated = self.aggregate_shared(server_round, valid, self.global_arrays)
        total = sum(r.num_examples for r in valid)
        loss = sum(float(r.metrics["train-loss"]) * r.num_examples for r in valid) / total
        self.ledger.record(server_round).train = {"loss": loss, "num_clients": len(valid)}
        return updated
