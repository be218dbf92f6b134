"""Who may get work: asking nodes who they are, and clients that come back on a new node.

The node table itself is ``identity.NodeDirectory``; this is the part that sends messages
(identify queries, a rejoining client's evaluation).
"""

from __future__ import annotations

from collections.abc import Callable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import RunSettings
from common.protocol import ACTION, CONFIG, IDENTIFY, evaluate_metric_keys
from strategies.engine.accounting import RoundLedger
from strategies.engine.evaluation import PendingEvaluation
from strategies.engine.exchange import Exchange, Messenger
from strategies.engine.identity import NodeDirectory, wait_for_nodes
from strategies.engine.privacy import PrivacyLedger
from strategies.engine.replies import ReplyCheck, stop_if_every_reply_failed

OnIdentified = Callable[[str, dict[str, Any]], None]


class Admission:
    def __init__(self, settings: RunSettings, nodes: NodeDirectory, messenger: Messenger,
                 replies: ReplyCheck, ledger: RoundLedger, evaluation: PendingEvaluation,
                 client_identified: OnIdentified, privacy: PrivacyLedger) -> None:
        self.settings = settings
        self.nodes = nodes
        self.messenger = messenger
        self.replies = replies
        self.ledger = ledger
        self.evaluation = evaluation
        self.client_identified = client_identified
        self.privacy = privacy  # a rejoin's evaluation is a release of its scores

    def connected(self, grid: Grid) -> list[int]:
        """The connected nodes, once there are ``min-nodes`` (or ``round-timeout`` passed)."""
        return wait_for_nodes(grid, self.nodes, self.settings.min_nodes,
                              self.settings.round_timeout)

    def identify_all(self, grid: Grid, server_round: int = 1) -> None:
        """Ask every connected node who it is, before the first round (``server_round``: the
        round its dropped replies are recorded under), so that everything per client is
        keyed by client id from the start. This is the run's preflight: a client answers
        only once its data loaded and its model built on its device; when every client
        fails the same way the run stops here (``stop_if_every_reply_failed``)."""
        nodes = self.connected(grid)
        batch = self._identify(grid, nodes, server_round)
        log(INFO, "identify: %d of %d nodes answered", len(self.nodes.client_info), len(nodes))
        stop_if_every_reply_failed(f"preflight before round {server_round}", server_round - 1,
                                   batch, self.settings.min_nodes)

    def identify_newcomers(self, grid: Grid, server_round: int, stage: str, nodes: list[int],
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
        self._identify(grid, new, server_round)
        rejoined = {n: self.nodes.node_to_client[n] for n in new
                    if self.nodes.client_of(n) in known - self.nodes.excluded_clients}
        if not rejoined:
            return
        if stage == MessageType.EVALUATE:
            self.evaluation.expect_rejoined(rejoined.values())
            return
        # the state it came back with: not ahead of the last completed round
        messages = self.messenger.address(server_round, rejoined, arrays, MessageType.EVALUATE,
                                          names_round=server_round - 1)
        valid = self.replies.valid(server_round, "rejoin", self.messenger.send(grid, messages),
                                   evaluate_metric_keys(self.settings.dp_mode))
        self.ledger.client_cpu(server_round, "evaluate", valid)
        self.privacy.scores_released(valid)
        self.evaluation.record_rejoined(server_round, {r.client_id: float(r.metrics["accuracy"])
                                                       for r in valid})

    def _identify(self, grid: Grid, nodes: list[int], server_round: int) -> Exchange:
        """Ask ``nodes`` who they are. A node that does not reply at all is ``silent`` (not
        sampled until it replies); one whose reply is dropped (a ClientApp without the
        ``identify`` query, a malformed reply) is alive and is learned from its train replies
        instead, unless its claim was refused (``NodeDirectory.claim``)."""
        batch = self.messenger.query(grid, {n: RecordDict({CONFIG: ConfigRecord(
            {ACTION: IDENTIFY})}) for n in nodes})
        self.nodes.heard_from(nodes, [node for node, _ in batch.replies])
        for reply in self.replies.valid(server_round, "identify", batch, None):
            info = dict(reply.info)
            self.nodes.identified(reply.node_id, reply.client_id, info)
            self.client_identified(reply.client_id, info)
        return batch
