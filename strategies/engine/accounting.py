"""Per-round accounting: the ``RoundRecord`` of every round, bytes, CPU time, dropped replies
and method extras, all kept by one ledger."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from logging import WARNING
from typing import Any

from flwr.app import Message, MessageType
from flwr.common.logger import log

from common.protocol import ARRAYS, ClientReply
from common.record import RoundRecord


class RoundLedger:
    """``history``: round -> ``RoundRecord`` (what ``results.json`` shows per round)."""

    def __init__(self) -> None:
        self.history: dict[int, RoundRecord] = {}

    def record(self, server_round: int) -> RoundRecord:
        return self.history.setdefault(server_round, RoundRecord())

    @contextmanager
    def server_cpu(self, server_round: int) -> Iterator[None]:
        """Add the process's CPU time inside the block (BLAS threads included) to the round's
        ``server`` seconds."""
        started = time.process_time()
        try:
            yield
        finally:
            self.record(server_round).add_cpu("server", time.process_time() - started)

    def client_cpu(self, server_round: int, stage: str, replies: Sequence[ClientReply],
                   cpu_metric: str = "cpu-seconds") -> None:
        """The clients' own CPU time (their ``cpu_metric``), and their ``seconds-<phase>``
        wall times (not for fused evaluations: those are the train message's), summed per
        stage (with the number of messages, for means)."""
        record = self.record(server_round)
        record.add_cpu(f"clients_{stage}",
                       sum(float(r.metrics.get(cpu_metric, 0.0)) for r in replies))
        if not replies or cpu_metric != "cpu-seconds":
            return
        phases = record.client_seconds.setdefault(stage, {"messages": 0})
        phases["messages"] += len(replies)
        for reply in replies:
            for name, value in reply.metrics.items():
                if name.startswith("seconds-") and isinstance(value, float):
                    phase = name.removeprefix("seconds-")
                    phases[phase] = phases.get(phase, 0.0) + value

    def exchanged(self, server_round: int, seconds: float) -> None:
        """Wall seconds the server waited for one exchange's replies."""
        self.record(server_round).exchange_seconds.append(seconds)

    def downlink(self, server_round: int, messages: list[Message]) -> None:
        """Bytes of the arrays in ``messages`` (all of one message type; a train message's
        count as training, the others' as evaluation)."""
        if not messages:
            return
        down = sum(m.content.array_records[ARRAYS].count_bytes() for m in messages
                   if ARRAYS in m.content.array_records)
        record = self.record(server_round)
        if messages[0].metadata.message_type == MessageType.TRAIN:
            record.bytes_down_train += down
        else:
            record.bytes_down_evaluate += down

    def uplink(self, server_round: int, reply: Message) -> None:
        """Bytes of the arrays a train or query reply carries (counted before validation: they
        crossed the wire either way)."""
        if not reply.has_error():
            self.record(server_round).bytes_up += sum(
                a.count_bytes() for a in reply.content.array_records.values())

    def drop(self, server_round: int, stage: str, node_id: int, client_id: str,
             reason: str) -> None:
        log(WARNING, "round %d %s: dropped reply of node %d (client %s): %s", server_round,
            stage, node_id, client_id, reason)
        self.record(server_round).dropped.append(
            {"stage": stage, "node": node_id, "client": client_id, "reason": reason})

    def report(self, server_round: int, name: str, value: Any) -> None:
        """A method's own per-round value: a top-level field of the round in results.json."""
        self.record(server_round).extra[name] = value

    def record_train(self, server_round: int, train: dict[str, Any]) -> None:
        """The round's training (``num_clients``, ``loss``)."""
        self.record(server_round).train = train

    def record_eval(self, server_round: int, stats: dict[str, Any]) -> None:
        """The round's personalized evaluation (``common.record.personalized_stats``)."""
        self.record(server_round).eval = stats

    def record_rejoined(self, server_round: int, scores: dict[str, float]) -> None:
        """The first accuracies of clients that came back on a new node (``rejoined``)."""
        self.record(server_round).extra.setdefault("rejoined", {}).update(scores)

    def restore_round(self, server_round: int, record: RoundRecord) -> None:
        """A round's record as a checkpoint kept it (its evaluation still to come)."""
        self.history[server_round] = record
