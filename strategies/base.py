"""The machinery every method's strategy shares (contracts §3-§5).

``PersonalizedStrategy`` is Flower's ``FedAvg`` with:
- one message per node, built by ``downlink`` (methods override it for per-client payloads),
- client ids (not node ids) as the key of everything per client, learned from replies,
- reply validation: keys, shapes, dtypes, finite values; a bad reply is dropped and logged,
- bytes accounting with ``ArrayRecord.count_bytes()``,
- personalized evaluation statistics over every client's own test split,
- a per-round ``history`` that the ServerApp turns into ``results.json``.

A method overrides ``downlink`` and/or ``aggregate_shared`` (and, if its uplink differs from
its downlink, ``expected_uplink``); nothing else.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from common.config import RunSettings

ARRAYS, CONFIG, METRICS, CLIENT = "arrays", "config", "metrics", "client"
NUM_EXAMPLES = "num-examples"
ArraySpec = dict[str, tuple[tuple[int, ...], str]]


def spec_of(arrays: ArrayRecord) -> ArraySpec:
    """key -> (shape, dtype) of every array in ``arrays``."""
    return {k: (tuple(a.shape), str(a.dtype)) for k, a in arrays.items()}


@dataclass
class ClientReply:
    """A validated reply: who sent it and what it carries."""

    node_id: int
    client_id: str
    arrays: ArrayRecord
    metrics: MetricRecord
    info: ConfigRecord

    @property
    def num_examples(self) -> int:
        return int(self.metrics[NUM_EXAMPLES])

    @property
    def content(self) -> RecordDict:
        return RecordDict({ARRAYS: self.arrays, METRICS: self.metrics})


@dataclass
class RoundRecord:
    """What happened in one round, for results.json."""

    bytes_up: int = 0
    bytes_down_train: int = 0
    bytes_down_evaluate: int = 0
    train: dict[str, Any] | None = None
    eval: dict[str, Any] | None = None
    dropped: list[dict[str, Any]] = field(default_factory=list)
    # CPU seconds: clients' train/evaluate handlers (their ``cpu-seconds`` metric, summed) and
    # the server's strategy work (message building, validation, aggregation)
    cpu_seconds: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # method-specific, e.g. similarities


class ReplyError(ValueError):
    """Why a reply was dropped."""


class PersonalizedStrategy(FedAvg):
    """FedAvg over a method's shared parameters, with per-node messages and validation."""

    # Attributes saved in the server checkpoint and restored on resume; a method adds its
    # per-client tables (``(*PersonalizedStrategy.checkpointed, "split")``).
    checkpointed: tuple[str, ...] = ("per_client_accuracy",)

    def __init__(self, settings: RunSettings, initial_arrays: ArrayRecord) -> None:
        super().__init__(
            fraction_train=settings.fraction_train,
            fraction_evaluate=settings.fraction_evaluate,
            min_train_nodes=1,
            min_evaluate_nodes=1,
            min_available_nodes=settings.min_nodes,
        )
        self.settings = settings
        self.shared_spec: ArraySpec = spec_of(initial_arrays)
        self.global_arrays = initial_arrays  # the shared arrays the current round started from
        self.node_to_client: dict[int, str] = {}
        self.history: dict[int, RoundRecord] = {}
        self.per_client_accuracy: dict[str, float] = {}
        self.client_info: dict[str, dict[str, Any]] = {}  # from the "identify" query
        self.excluded_clients: set[str] = set()  # never sampled for train/evaluate
        self.replaced_nodes: set[int] = set()  # old node ids of clients that came back
        self.silent_nodes: set[int] = set()  # no reply to their last identify query
        # added to every train/evaluate message's config (resume lineage, see server_app)
        self.message_config: dict[str, Any] = {}
        self._identify_tried: dict[int, int] = {}  # node -> round of its last identify
        self._rejoined_at_evaluate: set[str] = set()
        self._sent: list[Message] = []

    # ------------------------------------------------------------------ method hooks
    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        """The arrays one client receives (``client_id`` None: any client, e.g. a report)."""
        return arrays

    def on_identified(self, client_id: str, info: dict[str, Any]) -> None:
        """A node told the server who it is (at the start or when it joins later)."""

    def expected_uplink(self, client_id: str, info: ConfigRecord) -> ArraySpec:
        """key -> (shape, dtype) that a client's train reply must carry exactly (``info``:
        the reply's ``client`` ConfigRecord)."""
        return self.shared_spec

    def aggregate_shared(self, server_round: int, replies: list[ClientReply],
                         arrays: ArrayRecord) -> ArrayRecord:
        """New global shared arrays from the valid replies (default: weighted mean)."""
        return aggregate_arrayrecords([r.content for r in replies], NUM_EXAMPLES)

    def state_tables(self) -> dict[str, Any]:
        """Server-side per-client tables, keyed by client id (part of the checkpoint)."""
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything this strategy needs to continue a run: its ``checkpointed``
        attributes (picklable)."""
        return {name: getattr(self, name) for name in self.checkpointed}

    def restore_state(self, state: dict[str, Any]) -> None:
        for name in self.checkpointed:
            setattr(self, name, state[name])

    def after_training(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        """Work after the last round (e.g. FedFac's new-client evaluation); its result goes
        into results.json."""
        return None

    # ------------------------------------------------------------------ queries
    def query(self, grid: Grid, contents: dict[int, RecordDict]) -> list[Message]:
        """One ``query`` message per node (``contents``: node -> content with an ``action``
        in its ``config`` record); returns the replies that arrived in time."""
        messages = [Message(content, dst_node_id=node, message_type=MessageType.QUERY)
                    for node, content in contents.items()]
        self._sent = messages
        return list(grid.send_and_receive(messages, timeout=self.settings.round_timeout))

    def identify(self, grid: Grid) -> None:
        """Ask every connected node who it is, before the first round, so that everything
        per client is keyed by client id from the start."""
        nodes = self.connected_nodes(grid)
        self._identify_nodes(grid, nodes)
        log(INFO, "identify: %d of %d nodes answered", len(self.client_info), len(nodes))

    def _identify_nodes(self, grid: Grid, nodes: list[int]) -> None:
        """Ask ``nodes`` who they are. A node that does not reply at all is ``silent`` (not
        sampled until it replies); one that replies without a client id (a ClientApp without
        the ``identify`` query) is alive and is learned from its train replies instead."""
        replies = self.query(grid, {n: RecordDict({CONFIG: ConfigRecord({"action": "identify"})})
                                    for n in nodes})
        senders = self._senders(replies)
        self.silent_nodes.update(set(nodes) - set(senders))
        self.silent_nodes.difference_update(senders)
        for reply, node_id in zip(replies, senders, strict=True):
            info = (None if reply.has_error() else reply.content.config_records.get(CLIENT))
            if info is None or not isinstance(info.get("client-id"), str):
                log(WARNING, "identify: node %d did not answer (%s)", node_id,
                    reply.error.reason if reply.has_error() else "no client id")
                continue
            client_id = str(info["client-id"])
            # an earlier node of this client (a SuperNode that restarted) is gone for good
            self.replaced_nodes.update(n for n, c in self.node_to_client.items()
                                       if c == client_id and n != node_id)
            self.node_to_client[node_id] = client_id
            self.client_info[client_id] = dict(info)
            self.on_identified(client_id, dict(info))

    def admit_new_nodes(self, server_round: int, stage: str, grid: Grid, nodes: list[int],
                        arrays: ArrayRecord) -> None:
        """Identify nodes that connected since the last exchange, before they get work.

        A restarted SuperNode comes back with a new node id (and an empty ``context.state``);
        identified first, it gets its own per-client downlink at once, and its old node id is
        no longer sampled. A node is asked at most once a round (a node that does not reply is
        not sampled), so a round with newcomers waits at most one extra ``round-timeout`` for
        them, plus one for a rejoin evaluation.

        A client that was here before (a rejoin) is evaluated before it trains again, and its
        accuracy goes into this round's ``rejoined`` entry, which shows whether its personal
        state came back (from ``state-dir``). At the train exchange that is an extra evaluate
        message; at the evaluate exchange the regular evaluation is that first one."""
        new = [n for n in nodes if n not in self.node_to_client and n not in self.replaced_nodes
               and self._identify_tried.get(n) != server_round]
        if not new:
            return
        for node in new:
            self._identify_tried[node] = server_round
        known = set(self.client_info)
        self._identify_nodes(grid, new)
        rejoined = {n: self.node_to_client[n] for n in new
                    if self.node_to_client.get(n) in known - self.excluded_clients}
        if not rejoined:
            return
        if stage == MessageType.EVALUATE:
            self._rejoined_at_evaluate.update(rejoined.values())
            return
        # the state it came back with: not ahead of the last completed round
        messages = self._addressed(server_round, rejoined, arrays, ConfigRecord(),
                                   MessageType.EVALUATE, server_round - 1)
        self._sent = messages
        replies = grid.send_and_receive(messages, timeout=self.settings.round_timeout)
        valid = self._valid_replies(server_round, replies, "rejoin", ("accuracy", "loss"), False)
        self._add_client_cpu(server_round, "evaluate", valid)
        self._record_rejoined(server_round, valid)

    def _record_rejoined(self, server_round: int, replies: list[ClientReply]) -> None:
        scores = {r.client_id: float(r.metrics["accuracy"]) for r in replies}
        self._record(server_round).extra.setdefault("rejoined", {}).update(scores)
        for client_id, accuracy in scores.items():
            log(INFO, "round %d: client %s rejoined (new node); accuracy before training "
                "again %.4f (last before: %s)", server_round, client_id, accuracy,
                self.per_client_accuracy.get(client_id))

    def _samplable(self, nodes: list[int]) -> list[int]:
        """Nodes that are not silent, not replaced and not of ``excluded_clients``, in client
        order (so sampling does not depend on node ids, which change between runs)."""
        ok = [n for n in nodes if n not in self.silent_nodes and n not in self.replaced_nodes
              and self.node_to_client.get(n) not in self.excluded_clients]

        def order(node: int) -> tuple[int, str]:
            client_id = self.node_to_client.get(node)
            return client_order(client_id) if client_id else (1 << 31, str(node))

        return sorted(ok, key=order)

    # ------------------------------------------------------------------ messages
    def _record(self, server_round: int) -> RoundRecord:
        return self.history.setdefault(server_round, RoundRecord())

    @contextmanager
    def _server_cpu(self, server_round: int) -> Iterator[None]:
        """Add the process's CPU time inside the block (BLAS threads included) to the round's
        ``server`` seconds."""
        started = time.process_time()
        try:
            yield
        finally:
            cpu = self._record(server_round).cpu_seconds
            cpu["server"] = cpu.get("server", 0.0) + time.process_time() - started

    def _add_client_cpu(self, server_round: int, stage: str,
                        replies: list[ClientReply]) -> None:
        cpu = self._record(server_round).cpu_seconds
        cpu[f"clients_{stage}"] = cpu.get(f"clients_{stage}", 0.0) + sum(
            float(r.metrics.get("cpu-seconds", 0.0)) for r in replies)

    def connected_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes, once there are ``min-nodes`` of them.

        Waits at most ``round-timeout`` seconds: then it goes on with the nodes there are (a
        dead node must not stall the run), and fails with a clear error only if there are
        none."""
        deadline = time.monotonic() + self.settings.round_timeout
        while True:
            nodes = list(grid.get_node_ids())
            if len(nodes) >= self.min_available_nodes:
                return nodes
            if time.monotonic() >= deadline:
                if not nodes:
                    raise RuntimeError(f"no node connected within round-timeout "
                                       f"({self.settings.round_timeout:.0f} s)")
                log(WARNING, "only %d of min-nodes=%d nodes connected after %.0f s; going on",
                    len(nodes), self.min_available_nodes, self.settings.round_timeout)
                return nodes
            log(INFO, "waiting for nodes: %d connected, min-nodes=%d", len(nodes),
                self.min_available_nodes)
            time.sleep(1)

    def _addressed(self, server_round: int, clients: dict[int, str | None], arrays: ArrayRecord,
                   config: ConfigRecord, message_type: str, config_round: int
                   ) -> list[Message]:
        """One message per node (``clients``: node -> client id) with its own downlink, the
        run's ``message_config`` and ``server-round = config_round``; the arrays' bytes go
        into the round's downlink count."""
        messages = [Message(RecordDict({   # a fresh RecordDict per node: never shared
            ARRAYS: self.downlink(server_round, client_id, arrays),
            CONFIG: ConfigRecord({**config, **self.message_config, "server-round": config_round}),
        }), dst_node_id=node_id, message_type=message_type, group_id=str(server_round))
            for node_id, client_id in clients.items()]
        down = sum(m.content[ARRAYS].count_bytes() for m in messages)
        record = self._record(server_round)
        if message_type == MessageType.TRAIN:
            record.bytes_down_train += down
        else:
            record.bytes_down_evaluate += down
        return messages

    def _messages(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                  grid: Grid, fraction: float, message_type: str) -> list[Message]:
        if fraction == 0.0:
            self._sent = []
            return []
        nodes = self.connected_nodes(grid)
        self.admit_new_nodes(server_round, message_type, grid, nodes, arrays)
        eligible = self._samplable(nodes)
        node_ids = random.sample(eligible, min(len(eligible),
                                               max(int(len(eligible) * fraction), 1)))
        messages = self._addressed(server_round, {n: self.node_to_client.get(n) for n in node_ids},
                                   arrays, config, message_type, server_round)
        self._sent = messages
        if message_type == MessageType.TRAIN:
            self.global_arrays = arrays
        return messages

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        with self._server_cpu(server_round):
            return self._messages(server_round, arrays, config, grid, self.fraction_train,
                                  MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        with self._server_cpu(server_round):
            return self._messages(server_round, arrays, config, grid, self.fraction_evaluate,
                                  MessageType.EVALUATE)

    # ------------------------------------------------------------------ validation
    def _senders(self, replies: list[Message]) -> list[int]:
        """The node each reply answers for. Errors generated by the SuperLink come from node
        1, so replies are mapped through the message ids of what was sent (the Grid fills
        them in when it sends, hence one map per batch of replies)."""
        dst = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent}
        return [dst.get(r.metadata.reply_to_message_id, r.metadata.src_node_id)
                for r in replies]

    def _validate(self, reply: Message, metric_keys: tuple[str, ...],
                  expect_arrays: bool) -> ClientReply:
        if reply.has_error():
            raise ReplyError(f"error reply (code {reply.error.code}): {reply.error.reason}")
        content = reply.content
        info = content.config_records.get(CLIENT)
        if info is None or not isinstance(info.get("client-id"), str):
            raise ReplyError("no ConfigRecord 'client' with a string 'client-id'")
        client_id = info["client-id"]
        metrics = content.metric_records.get(METRICS)
        if metrics is None:
            raise ReplyError("no MetricRecord 'metrics'")
        missing = [k for k in (NUM_EXAMPLES, *metric_keys) if k not in metrics]
        if missing:
            raise ReplyError(f"metrics lack {missing}")
        for key, value in metrics.items():
            values = value if isinstance(value, list) else [value]
            if not all(math.isfinite(float(v)) for v in values):
                raise ReplyError(f"metric {key!r} is not finite")
        if not (isinstance(metrics[NUM_EXAMPLES], int) and metrics[NUM_EXAMPLES] > 0):
            raise ReplyError(f"{NUM_EXAMPLES} must be a positive int")
        arrays = content.array_records.get(ARRAYS, ArrayRecord())
        if expect_arrays:
            self._check_arrays(arrays, self.expected_uplink(client_id, info))
        return ClientReply(reply.metadata.src_node_id, client_id, arrays, metrics, info)

    @staticmethod
    def _check_arrays(arrays: ArrayRecord, expected: ArraySpec) -> None:
        got = set(arrays.keys())
        if got != set(expected):
            unknown, missing = sorted(got - set(expected)), sorted(set(expected) - got)
            raise ReplyError(f"array keys differ: unknown {unknown[:5]}, missing {missing[:5]}")
        for key, (shape, dtype) in expected.items():
            array = arrays[key]
            if tuple(array.shape) != shape:
                raise ReplyError(f"{key!r} has shape {tuple(array.shape)}, expected {shape}")
            if str(array.dtype) != dtype:
                raise ReplyError(f"{key!r} has dtype {array.dtype}, expected {dtype}")
            values = array.numpy()
            if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
                raise ReplyError(f"{key!r} has non-finite values")

    def _valid_replies(self, server_round: int, replies: Iterable[Message], stage: str,
                       metric_keys: tuple[str, ...], expect_arrays: bool) -> list[ClientReply]:
        record = self._record(server_round)
        valid = []
        replies = list(replies)
        senders = self._senders(replies)
        answered = set(senders)
        for message in self._sent:
            node_id = message.metadata.dst_node_id
            if node_id not in answered:  # the round timed out before this node replied
                client_id = self.node_to_client.get(node_id, "?")
                reason = f"no reply within round-timeout ({self.settings.round_timeout:.0f} s)"
                log(WARNING, "round %d %s: node %d (client %s): %s", server_round, stage,
                    node_id, client_id, reason)
                record.dropped.append({"stage": stage, "node": node_id, "client": client_id,
                                       "reason": reason})
        for reply, node_id in zip(replies, senders, strict=True):
            if stage == "train" and not reply.has_error():
                record.bytes_up += sum(a.count_bytes()
                                       for a in reply.content.array_records.values())
            try:
                checked = self._validate(reply, metric_keys, expect_arrays)
            except ReplyError as reason:
                client_id = self.node_to_client.get(node_id) or _claimed_client_id(reply)
                log(WARNING, "round %d %s: dropped reply of node %d (client %s): %s",
                    server_round, stage, node_id, client_id, reason)
                record.dropped.append({"stage": stage, "node": node_id, "client": client_id,
                                       "reason": str(reason)})
                continue
            self.node_to_client[node_id] = checked.client_id
            valid.append(checked)
        # Reply order is arbitrary; a fixed order makes float sums (and runs) reproducible.
        return sorted(valid, key=lambda r: client_order(r.client_id))

    # ------------------------------------------------------------------ aggregation
    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        with self._server_cpu(server_round):
            return self._aggregate_train(server_round, replies)

    def _aggregate_train(self, server_round: int, replies: Iterable[Message]
                         ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid = self._valid_replies(server_round, replies, "train", ("train-loss",), True)
        self._add_client_cpu(server_round, "train", valid)
        if not valid:
            log(WARNING, "round %d: no valid train reply; the shared model is unchanged",
                server_round)
            return None, None
        arrays = self.aggregate_shared(server_round, valid, self.global_arrays)
        total = sum(r.num_examples for r in valid)
        loss = sum(float(r.metrics["train-loss"]) * r.num_examples for r in valid) / total
        self._record(server_round).train = {"loss": loss, "num_clients": len(valid)}
        return arrays, MetricRecord({"train-loss": loss, "num-clients": len(valid)})

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        with self._server_cpu(server_round):
            return self._aggregate_evaluate(server_round, replies)

    def _aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                            ) -> MetricRecord | None:
        valid = self._valid_replies(server_round, replies, "evaluate", ("accuracy", "loss"),
                                    False)
        self._add_client_cpu(server_round, "evaluate", valid)
        rejoined = [r for r in valid if r.client_id in self._rejoined_at_evaluate]
        if rejoined:
            self._record_rejoined(server_round, rejoined)
            self._rejoined_at_evaluate.difference_update(r.client_id for r in rejoined)
        if not valid:
            return None
        stats = personalized_stats({r.client_id: (float(r.metrics["accuracy"]), r.num_examples)
                                    for r in valid})
        self._record(server_round).eval = stats
        self.per_client_accuracy.update(stats["per_client"])
        log(INFO, "round %d: personalized accuracy weighted %.4f mean %.4f min %.4f (%d clients)",
            server_round, stats["accuracy_weighted"], stats["accuracy_mean"],
            stats["accuracy_min"], stats["num_clients"])
        return MetricRecord({k: v for k, v in stats.items() if k != "per_client"})


def _claimed_client_id(reply: Message) -> str:
    """The client id a (possibly malformed) reply says it comes from, for log lines."""
    if reply.has_error() or CLIENT not in reply.content.config_records:
        return "?"
    return str(reply.content.config_records[CLIENT].get("client-id", "?"))


def personalized_stats(per_client: dict[str, tuple[float, int]]) -> dict[str, Any]:
    """Contracts §3: weighted/mean/std/min accuracy over clients, plus the per-client map."""
    accuracy = np.array([a for a, _ in per_client.values()])
    examples = np.array([n for _, n in per_client.values()], dtype=float)
    return {
        "accuracy_weighted": float((accuracy * examples).sum() / examples.sum()),
        "accuracy_mean": float(accuracy.mean()),
        "accuracy_std": float(accuracy.std()),
        "accuracy_min": float(accuracy.min()),
        "num_clients": len(per_client),
        "per_client": {cid: a for cid, (a, _) in sorted(per_client.items(),
                                                        key=lambda kv: client_order(kv[0]))},
    }


def client_order(client_id: str) -> tuple[int, str]:
    return (int(client_id), "") if client_id.isdigit() else (1 << 30, client_id)
