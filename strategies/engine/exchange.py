"""Sending messages to nodes: one batch at a time (``exchange``), each node its own message
(``Messenger``).

``exchange`` sends and waits, and maps every reply to the node it answers for (errors made by
the SuperLink come from node 1, so replies are matched through the ids of the messages sent).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import httpx
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import RunSettings
from common.protocol import ARRAYS, CONFIG, EVALUATE_FIRST, SERVER_ROUND
from strategies.engine.accounting import RoundLedger

POLL_SECONDS = 0.2
# A SuperLink that keeps answering pulls with errors this long is broken, not busy.
BUSY_SUPERLINK_SECONDS = 30.0
Downlink = Callable[[int, str | None, ArrayRecord], ArrayRecord]
"""(round, client id or None, the shared arrays) -> what that client receives."""


@dataclass
class Exchange:
    """One batch: the messages sent and the replies that came back, each with its node."""

    sent: list[Message]
    replies: list[tuple[int, Message]]

    def by_type(self) -> dict[str, Exchange]:
        """The batch split by message type (``train`` / ``evaluate``), each reply with the
        message it answers."""
        type_of = {m.metadata.dst_node_id: m.metadata.message_type for m in self.sent}
        return {kind: Exchange([m for m in self.sent if m.metadata.message_type == kind],
                               [(n, r) for n, r in self.replies if type_of.get(n) == kind])
                for kind in (MessageType.TRAIN, MessageType.EVALUATE)}

    def missing(self) -> list[int]:
        """Nodes that were sent a message and did not reply in time."""
        answered = {node for node, _ in self.replies}
        return [m.metadata.dst_node_id for m in self.sent
                if m.metadata.dst_node_id not in answered]


def exchange(grid: Grid, messages: list[Message], timeout: float,
             in_flight: int = 100) -> Exchange:
    """Send ``messages`` and collect their replies until all are in or ``timeout`` seconds
    have passed, looking every ``POLL_SECONDS`` (Flower's ``send_and_receive`` looks every
    3 s in a deployment, so each exchange would end on a 3 s boundary).

    At most ``in_flight`` messages (``max-in-flight``) wait for a reply at a time; the next go
    out as replies come in. Flower's simulation (1.42) scans every stored message for every
    node ten times a second (``InMemoryLinkState.get_message_ins``), so 1,000 messages pushed at
    once to 1,000 nodes cost it about a million checks a pass; a bounded window keeps that
    linear in the nodes."""
    if not messages:
        return Exchange([], [])
    waiting = list(messages)
    pending: set[str] = set()
    deadline = time.monotonic() + timeout
    replies: list[Message] = []
    failing_since: float | None = None
    while True:
        if waiting and len(pending) < in_flight:
            room = in_flight - len(pending)
            batch, waiting = waiting[:room], waiting[room:]
            pending.update(grid.push_messages(batch))  # the Grid fills in the message ids
        arrived, failing_since = _pull(grid, pending, failing_since)
        replies += arrived
        pending.difference_update(r.metadata.reply_to_message_id for r in arrived)
        if (not pending and not waiting) or time.monotonic() >= deadline:
            break
        if not arrived or not waiting:
            time.sleep(min(POLL_SECONDS, max(deadline - time.monotonic(), 0.0)))
    destination = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    return Exchange(messages, [(destination.get(r.metadata.reply_to_message_id,
                                                r.metadata.src_node_id), r) for r in replies])


def _pull(grid: Grid, pending: Iterable[str], failing_since: float | None
          ) -> tuple[list[Message], float | None]:
    """The replies that have arrived, and since when pulls have failed (None: this one did
    not). A SuperLink under load answers a pull with HTTP 500 when its SQLite store stays
    locked past its 5 s busy timeout ("database is locked"); Flower's HTTP client retries 502,
    503 and 504 but not 500, so the pull is tried again at the next poll, up to
    ``BUSY_SUPERLINK_SECONDS`` of failures in a row. Where the lock failed the first step
    (marking the replies delivered), the replies are still there for the next pull; where it
    failed a later one (deleting them, or confirming their receipt), the SuperLink has handed
    them over and they are lost: their nodes count as not replying in time, as a dead node
    does, instead of the whole run failing."""
    try:
        return list(grid.pull_messages(pending)), None
    except httpx.HTTPStatusError as error:
        now = time.monotonic()
        if (error.response.status_code != httpx.codes.INTERNAL_SERVER_ERROR
                or (failing_since is not None and now - failing_since > BUSY_SUPERLINK_SECONDS)):
            raise
        log(WARNING, "the SuperLink answered a pull with %s (busy?); pulling again; a reply "
            "it had already handed over is lost", error.response.status_code)
        return [], failing_since if failing_since is not None else now


@dataclass
class Messenger:
    """Every message the engine sends: one per node with that client's own downlink, the
    exchange that sends a batch and waits for its replies, and queries; the bytes down and
    the waits go into the ledger."""

    settings: RunSettings
    ledger: RoundLedger
    downlink: Downlink
    # added to every train/evaluate message's config (a resumed run's lineage: server_app)
    message_config: dict[str, Any] = field(default_factory=dict)

    def set_message_config(self, config: dict[str, Any]) -> None:
        """Added to every train and evaluate message's config from now on."""
        self.message_config = dict(config)

    def address(self, server_round: int, clients: dict[int, str | None], arrays: ArrayRecord,
                message_type: str, *, names_round: int | None = None,
                evaluate_first: set[int] | frozenset[int] = frozenset(),
                config: dict[str, Any] | None = None) -> list[Message]:
        """One message per node (``clients``: node -> client id) of round ``server_round``
        (its bytes down go into that round's count) with its own downlink, the run's
        ``message_config``, this exchange's ``config`` (a DP run's clip norm) and
        ``server-round``: ``server_round``, or ``names_round`` (a rejoining client's
        evaluation names the last completed round); for the nodes in ``evaluate_first``,
        the fused-evaluation flag."""
        messages = [Message(RecordDict({   # a fresh RecordDict per node: never shared
            ARRAYS: self.downlink(server_round, client_id, arrays),
            CONFIG: ConfigRecord({**self.message_config, **(config or {}),
                                  SERVER_ROUND: (server_round if names_round is None
                                                 else names_round),
                                  **({EVALUATE_FIRST: True} if node_id in evaluate_first
                                     else {})}),
        }), dst_node_id=node_id, message_type=message_type, group_id=str(server_round))
            for node_id, client_id in clients.items()]
        self.ledger.downlink(server_round, messages)
        return messages

    def send(self, grid: Grid, messages: list[Message]) -> Exchange:
        """One exchange; its wait goes into the round of its messages (``group_id``)."""
        started = time.perf_counter()
        batch = exchange(grid, messages, self.settings.round_timeout,
                         self.settings.max_in_flight)
        if messages:
            self.ledger.exchanged(int(messages[0].metadata.group_id),
                                  time.perf_counter() - started)
        return batch

    def query(self, grid: Grid, contents: dict[int, RecordDict],
              server_round: int | None = None) -> Exchange:
        """One ``query`` message per node (``contents``: node -> content with an ``action``
        in its ``config`` record); the replies that arrived in time. With ``server_round``,
        the arrays' bytes both ways go into that round's record (identify queries carry
        none)."""
        messages = [Message(content, dst_node_id=node, message_type=MessageType.QUERY)
                    for node, content in contents.items()]
        if server_round is not None:
            self.ledger.downlink(server_round, messages)
        batch = exchange(grid, messages, self.settings.round_timeout,
                         self.settings.max_in_flight)
        if server_round is not None:
            for _, reply in batch.replies:
                self.ledger.uplink(server_round, reply)
        return batch
