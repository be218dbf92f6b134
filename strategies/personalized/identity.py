"""Who is behind each node: client ids learned from replies, and which nodes may get work.

Flower node ids are random and change when a SuperNode restarts; everything per client is
keyed by the ``client-id`` every reply carries (contracts §1). A node is asked who it is (the
``identify`` query) before it gets work, so that a client that comes back on a new node gets
its own per-client downlink at once and its old node is no longer sampled.
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log
from flwr.serverapp import Grid

from common.protocol import client_order


class NodeDirectory:
    """node id <-> client id, and the nodes' standing."""

    def __init__(self) -> None:
        self.node_to_client: dict[int, str] = {}
        self.client_info: dict[str, dict[str, Any]] = {}  # from the "identify" query
        self.excluded_clients: set[str] = set()  # never sampled for train/evaluate
        self.replaced_nodes: set[int] = set()  # old node ids of clients that came back
        self.silent_nodes: set[int] = set()  # no reply to their last identify query
        self._identify_tried: dict[int, int] = {}  # node -> round of its last identify

    def client_of(self, node_id: int) -> str | None:
        return self.node_to_client.get(node_id)

    def learn(self, node_id: int, client_id: str) -> None:
        """A valid reply of ``node_id`` came from ``client_id``."""
        self.node_to_client[node_id] = client_id

    def identified(self, node_id: int, client_id: str, info: dict[str, Any]) -> None:
        """``node_id`` answered the identify query as ``client_id``; an earlier node of the
        same client (a SuperNode that restarted) is gone for good."""
        self.replaced_nodes.update(n for n, c in self.node_to_client.items()
                                   if c == client_id and n != node_id)
        self.node_to_client[node_id] = client_id
        self.client_info[client_id] = info

    def heard_from(self, asked: list[int], answered: list[int]) -> None:
        """Nodes that did not answer an identify query are silent (not sampled) until they
        answer one."""
        self.silent_nodes.update(set(asked) - set(answered))
        self.silent_nodes.difference_update(answered)

    def unidentified(self, nodes: list[int], server_round: int) -> list[int]:
        """Nodes not known yet and not asked yet this round (a node is asked at most once a
        round); marks them as asked."""
        new = [n for n in nodes if n not in self.node_to_client and n not in self.replaced_nodes
               and self._identify_tried.get(n) != server_round]
        for node in new:
            self._identify_tried[node] = server_round
        return new

    def samplable(self, nodes: list[int]) -> list[int]:
        """Nodes that are not silent, not replaced and not of ``excluded_clients``, in client
        order (so sampling does not depend on node ids, which change between runs)."""
        ok = [n for n in nodes if n not in self.silent_nodes and n not in self.replaced_nodes
              and self.node_to_client.get(n) not in self.excluded_clients]

        def order(node: int) -> tuple[int, str]:
            client_id = self.node_to_client.get(node)
            return client_order(client_id) if client_id else (1 << 31, str(node))

        return sorted(ok, key=order)

    def nodes_of(self, clients: set[str]) -> list[int]:
        """The current nodes of ``clients``."""
        return [n for n, c in self.node_to_client.items()
                if c in clients and n not in self.replaced_nodes]


def wait_for_nodes(grid: Grid, min_nodes: int, timeout: float) -> list[int]:
    """The connected nodes, once there are ``min_nodes`` of them.

    Waits at most ``timeout`` seconds: then it goes on with the nodes there are (a dead node
    must not stall the run), and fails with a clear error only if there are none."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= min_nodes:
            return nodes
        if time.monotonic() >= deadline:
            if not nodes:
                raise RuntimeError(f"no node connected within round-timeout ({timeout:.0f} s)")
            log(WARNING, "only %d of min-nodes=%d nodes connected after %.0f s; going on",
                len(nodes), min_nodes, timeout)
            return nodes
        log(INFO, "waiting for nodes: %d connected, min-nodes=%d", len(nodes), min_nodes)
        time.sleep(1)
