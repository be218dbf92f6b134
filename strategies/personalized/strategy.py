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
    ACTION,
    ARRAYS,
    CONFIG,
    EVALUATE_METRICS,
    IDENTIFY,
    SERVER_ROUND,
    TRAIN_METRICS,
    ArraySpec,
    ClientReply,
)
from common.record import personalized_stats
from strategies.personalized.accounting import RoundLedger
from strategies.personalized.identity import NodeDirectory
from strategies.personalized.replies import Exchange, exchange, valid_replies
from strategies.personalized.robust import ExampleCounts, aggregate
from strategies.wire import Masks, WireSpec


class PersonalizedStrategy:
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
                       reference: ArrayRecord) -> ArrayRecord:
        """``keys`` of the replies' arrays by the run's ``aggregation.*`` rule (``reference``:
        the arrays the round started from, for update clipping)."""
        return aggregate(replies, keys, reference, self.settings)

    def report(self, server_round: int, name: str, value: Any) -> None:
        """A per-round value of the method, shown in that round's entry of results.json."""
        self.ledger.report(server_round, name, value)

    def checked_replies(self, server_round: int, stage: str, batch: Exchange,
                        metric_keys: tuple[str, ...] | None,
                        expected_arrays: Callable[[ClientReply], ArraySpec] | None = None
                        ) -> list[ClientReply]:
        """The replies of ``batch`` that pass validation (``replies.valid_replies``, the one
        path for every exchange; ``metric_keys`` None: a query), with train and evaluate
        example counts bounded by each client's first report (``robust.ExampleCounts``)."""
        valid = valid_replies(self.ledger, self.nodes, server_round, stage, batch,
                              metric_keys, self.settings.round_timeout, expected_arrays,
                              max_examples=self.settings.max_num_examples)
        if stage in ("train", "evaluate"):
            self.example_counts.bound(stage, valid)
        return valid

    def query(self, grid: Grid, contents: dict[int, RecordDict]) -> Exchange:
        """One ``query`` message per node (``contents``: node -> content with an ``action``
        in its ``config`` record); the replies that arrived in time."""
        return exchange(grid, [Message(content, dst_node_id=node, message_type=MessageType.QUERY)
                               for node, content in contents.items()],
                        self.settings.round_timeout)

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

    # ------------------------------------------------------------------ identity
    def identify(self, grid: Grid, server_round: int = 1) -> None:
        """Ask every connected node who it is, before the first round (``server_round``: the
        round its dropped replies are recorded under), so that everything per client is
        keyed by client id from the start."""
        nodes = self.connected_nodes(grid)
        self._identify_nodes(grid, nodes, server_round)
        log(INFO, "identify: %d of %d nodes answered", len(self.nodes.client_info), len(nodes))

    def _identify_nodes(self, grid: Grid, nodes: list[int], server_round: int) -> None:
        """Ask ``nodes`` who they are. A node that does not reply at all is ``silent`` (not
        sampled until it replies); one whose reply is dropped (a ClientApp without the
        ``identify`` query, a malformed reply) is alive and is learned from its train replies
        instead, unless its claim was refused (``NodeDirectory.claim``)."""
        batch = self.query(grid, {n: RecordDict({CONFIG: ConfigRecord({ACTION: IDENTIFY})})
                                  for n in nodes})
        self.nodes.heard_from(nodes, [node for node, _ in batch.replies])
        for reply in self.checked_replies(server_round, "identify", batch, None):
            info = dict(reply.info)
            self.nodes.identified(reply.node_id, reply.client_id, info)
            self.on_identified(reply.client_id, info)

    def admit_new_nodes(self, server_round: int, stage: str, grid: Grid, nodes: list[int],
                        arrays: ArrayRecord) -> None:
        """Identify nodes that connected since the last exchange, before they get work.

        A restarted SuperNode comes back with a new node id (and an empty ``context.state``);
        identified first, it gets its own per-client downlink at once, and its old node id is
        no longer sampled. A round with newcomers waits at most one extra ``round-timeout``
        for them, plus one for a rejoin evaluation.

        A client that was here before (a rejoin) is evaluated before it trains again, and its
        accuracy goes into this round's ``rejoined`` entry, which shows whether its personal
        state came back (from ``state-dir``). At the train exchange that is an extra evaluate
        message; at the evaluate exchange the regular evaluation is that first one."""
        new = self.nodes.unidentified(nodes, server_round)
        if not new:
            return
        known = set(self.nodes.client_info)
        self._identify_nodes(grid, new, server_round)
        rejoined = {n: self.nodes.node_to_client[n] for n in new
                    if self.nodes.client_of(n) in known - self.nodes.excluded_clients}
        if not rejoined:
            return
        if stage == MessageType.EVALUATE:
            self._rejoined_at_evaluate.update(rejoined.values())
            return
        # the state it came back with: not ahead of the last completed round
        messages = self._addressed(server_round, rejoined, arrays, MessageType.EVALUATE,
                                   server_round - 1)
        valid = self.checked_replies(server_round, "rejoin",
                                     exchange(grid, messages, self.settings.round_timeout),
                                     EVALUATE_METRICS)
        self.ledger.client_cpu(server_round, "evaluate", valid)
        self._record_rejoined(server_round, valid)

    def _record_rejoined(self, server_round: int, replies: list[ClientReply]) -> None:
        scores = {r.client_id: float(r.metrics["accuracy"]) for r in replies}
        self.ledger.record(server_round).extra.setdefault("rejoined", {}).update(scores)
        for client_id, accuracy in scores.items():
            log(INFO, "round %d: client %s rejoined (new node); accuracy before training "
                "again %.4f (last before: %s)", server_round, client_id, accuracy,
                self.per_client_accuracy.get(client_id))

    def connected_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, once there are ``min-nodes`` of them.

        Waits at most ``round-timeout`` seconds: then it goes on with the nodes there are (a
        dead node must not stall the run), and fails with a clear error only if there are
        none."""
        deadline = time.monotonic() + self.settings.round_timeout
        while True:
            nodes = self.nodes.observe(grid.get_nodes())
            if len(nodes) >= self.settings.min_nodes:
                return nodes
            if time.monotonic() >= deadline:
                if not nodes:
                    raise RuntimeError(f"no node connected within round-timeout "
                                       f"({self.settings.round_timeout:.0f} s)")
                log(WARNING, "only %d of min-nodes=%d nodes connected after %.0f s; going on",
                    len(nodes), self.settings.min_nodes, self.settings.round_timeout)
                return nodes
            log(INFO, "waiting for nodes: %d connected, min-nodes=%d", len(nodes),
                self.settings.min_nodes)
            time.sleep(1)

    # ------------------------------------------------------------------ messages
    def _addressed(self, server_round: int, clients: dict[int, str | None], arrays: ArrayRecord,
                   message_type: str, config_round: int) -> list[Message]:
        """One message per node (``clients``: node -> client id) with its own downlink, the
        run's ``message_config`` and ``server-round = config_round``; the arrays' bytes go
        into the round's downlink count."""
        messages = [Message(RecordDict({   # a fresh RecordDict per node: never shared
            ARRAYS: self.downlink(server_round, client_id, arrays),
            CONFIG: ConfigRecord({**self.message_config, SERVER_ROUND: config_round}),
        }), dst_node_id=node_id, message_type=message_type, group_id=str(server_round))
            for node_id, client_id in clients.items()]
        self.ledger.downlink(server_round, messages)
        return messages

    def _sample(self, server_round: int, arrays: ArrayRecord, grid: Grid, fraction: float,
                message_type: str) -> list[Message]:
        """Messages to a ``fraction`` of the samplable nodes (newcomers identified first)."""
        if fraction == 0.0:
            return []
        nodes = self.connected_nodes(grid)
        self.admit_new_nodes(server_round, message_type, grid, nodes, arrays)
        eligible = self.nodes.samplable(nodes)
        node_ids = random.sample(eligible, min(len(eligible),
                                               max(int(len(eligible) * fraction), 1)))
        return self._addressed(server_round, {n: self.nodes.client_of(n) for n in node_ids},
                               arrays, message_type, server_round)

    # ------------------------------------------------------------------ rounds
    def train_round(self, grid: Grid, server_round: int, arrays: ArrayRecord
                    ) -> ArrayRecord | None:
        """Sample, send, validate, aggregate; the new shared arrays (None: no valid reply,
        the shared model stays as it was)."""
        with self.ledger.server_cpu(server_round):
            self.forget_expired(server_round)
            self.begin_round(server_round)
            messages = self._sample(server_round, arrays, grid, self.settings.fraction_train,
                                    MessageType.TRAIN)
            self.global_arrays = arrays
        batch = exchange(grid, messages, self.settings.round_timeout)
        with self.ledger.server_cpu(server_round):
            masks = self.uplink_masks()
            valid = self.checked_replies(
                server_round, "train", batch, TRAIN_METRICS,
                expected_arrays=lambda reply: self.wire.uplink_spec(reply.info, masks))
            self.ledger.client_cpu(server_round, "train", valid)
            if not valid:
                log(WARNING, "round %d: no valid train reply; the shared model is unchanged",
                    server_round)
                return None
            updated = self.aggregate_shared(server_round, valid, self.global_arrays)
            total = sum(r.num_examples for r in valid)
            loss = sum(float(r.metrics["train-loss"]) * r.num_examples for r in valid) / total
            self.ledger.record(server_round).train = {"loss": loss, "num_clients": len(valid)}
            return updated

    def evaluate_round(self, grid: Grid, server_round: int, arrays: ArrayRecord) -> None:
        """Every sampled client scores its personalized model on its own test split."""
        with self.ledger.server_cpu(server_round):
            messages = self._sample(server_round, arrays, grid,
                                    self.settings.fraction_evaluate, MessageType.EVALUATE)
        batch = exchange(grid, messages, self.settings.round_timeout)
        with self.ledger.server_cpu(server_round):
            valid = self.checked_replies(server_round, "evaluate", batch, EVALUATE_METRICS)
            self.ledger.client_cpu(server_round, "evaluate", valid)
            rejoined = [r for r in valid if r.client_id in self._rejoined_at_evaluate]
            if rejoined:
                self._record_rejoined(server_round, rejoined)
                self._rejoined_at_evaluate.difference_update(r.client_id for r in rejoined)
            if not valid:
                return
            stats = personalized_stats({r.client_id: (float(r.metrics["accuracy"]),
                                                      r.num_examples) for r in valid})
            self.ledger.record(server_round).eval = stats
            self.per_client_accuracy.update(stats["per_client"])
            log(INFO, "round %d: personalized accuracy weighted %.4f mean %.4f min %.4f "
                "(%d clients)", server_round, stats["accuracy_weighted"],
                stats["accuracy_mean"], stats["accuracy_min"], stats["num_clients"])
