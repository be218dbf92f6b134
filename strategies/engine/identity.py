"""Who is behind each node: client ids bound to nodes, and which nodes may get work.

Flower node ids are random and change when a SuperNode restarts; everything per client is
keyed by the ``client-id`` every reply carries (contracts §1). A node is asked who it is (the
``identify`` query) before it gets work, so that a client that comes back on a new node gets
its own per-client downlink at once and its old node is no longer sampled.

A client id belongs to one node at a time (``NodeDirectory.claim``, docs/security.md):

- a node with a registered name (SuperNode authentication, ``flwr supernode register ...
  --name``, seen through ``grid.get_nodes()``) may speak only for the client id equal to its
  name, or for the ids ``identity.node-owners`` gives it; with ``identity.require-registered``
  a node without a registered name may speak for none;
- a node keeps the client id it first spoke for;
- an id held by another node that is live (connected) and responsive (answered its last
  message) is refused, never taken over; a restarted SuperNode rejoins once its old node is
  gone or has missed a message;
- ``identity.max-clients`` caps the number of ids, and ids not heard from for
  ``identity.expire-rounds`` rounds are forgotten (``expire``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import RunSettings, node_owners
from common.protocol import client_order, shown


class NodeDirectory:
    """node id <-> client id, and the nodes' standing."""

    def __init__(self, settings: RunSettings | None = None) -> None:
        self.node_to_client: dict[int, str] = {}
        self.client_info: dict[str, dict[str, Any]] = {}  # from the "identify" query
        self.excluded_clients: set[str] = set()  # never sampled for train/evaluate
        self.replaced_nodes: set[int] = set()  # old node ids of clients that came back
        self.silent_nodes: set[int] = set()  # no reply to their last identify query
        self.unresponsive: set[int] = set()  # missed the last message they were sent
        self.refused_nodes: set[int] = set()  # their last claim was refused: not sampled
        self.last_seen: dict[str, int] = {}  # client id -> last round it was heard from
        self.names: dict[int, str] = {}  # node id -> registered name ("" = none)
        self.live: set[int] | None = None  # connected at the last look (None: never looked)
        self._identify_tried: dict[int, int] = {}  # node -> round of its last identify
        self.owners = node_owners(settings.node_owners) if settings else {}
        self.require_registered = settings.require_registered if settings else False
        self.max_clients = settings.max_clients if settings else 0
        self.expire_rounds = settings.expire_rounds if settings else 0

    def client_of(self, node_id: int) -> str | None:
        return self.node_to_client.get(node_id)

    def observe(self, nodes: Iterable[Any]) -> list[int]:
        """The connected nodes (``grid.get_nodes()``'s ``NodeInfo``): remember which are live
        and their registered names; returns their ids."""
        ids = []
        for info in nodes:
            ids.append(int(info.node_id))
            self.names[int(info.node_id)] = str(getattr(info, "name", "") or "")
        self.live = set(ids)
        return ids

    # ------------------------------------------------------------------ claims
    def claim(self, node_id: int, client_id: str, server_round: int) -> str | None:
        """``node_id`` says it speaks for ``client_id``: bind them and return None, or return
        why the claim is refused (the reply is then dropped)."""
        reason = self._refusal(node_id, client_id)
        if reason is not None:
            if self.node_to_client.get(node_id) is None:
                self.refused_nodes.add(node_id)
            return reason
        holders = [n for n, c in self.node_to_client.items()
                   if c == client_id and n != node_id and n not in self.replaced_nodes]
        self.replaced_nodes.update(holders)  # gone or silent: the client came back
        self.node_to_client[node_id] = client_id
        self.refused_nodes.discard(node_id)
        self.last_seen[client_id] = max(server_round, self.last_seen.get(client_id, 0))
        return None

    def contested(self, claims: list[tuple[int, str]]) -> set[str]:
        """Client ids that several nodes of one batch claim while none of them holds it: no
        claimant gets it (without authentication nothing tells which one is genuine)."""
        claimants: dict[str, set[int]] = {}
        for node_id, client_id in claims:
            if self._refusal(node_id, client_id) is None:  # a claim it may make at all
                claimants.setdefault(client_id, set()).add(node_id)
        return {c for c, found in claimants.items()
                if len(found) > 1 and not any(self.node_to_client.get(n) == c for n in found)}

    def _refusal(self, node_id: int, client_id: str) -> str | None:
        name = self.names.get(node_id, "")
        if name:
            allowed = self.owners.get(name, {name})
            if client_id not in allowed:
                return (f"node registered as {shown(name)} may not speak for client id "
                        f"{client_id} (allowed: {', '.join(sorted(allowed))})")
        elif self.require_registered:
            return (f"node has no registered name (identity.require-registered) and may "
                    f"not speak for client id {client_id}")
        bound = self.node_to_client.get(node_id)
        if bound is not None and bound != client_id:
            return f"node speaks for client id {bound}, not {client_id}"
        for other, held in self.node_to_client.items():
            if (held == client_id and other != node_id and other not in self.replaced_nodes
                    and self._responsive(other)):
                return f"client id {client_id} is held by live node {other}"
        if (bound is None and client_id not in self.last_seen and self.max_clients
                and len(self.last_seen) >= self.max_clients):
            return f"identity.max-clients={self.max_clients} client ids are known"
        return None

    def _responsive(self, node_id: int) -> bool:
        """Live (connected at the last look) and answered its last message."""
        live = self.live is None or node_id in self.live
        return live and node_id not in self.unresponsive and node_id not in self.silent_nodes

    def answered(self, node_ids: Iterable[int]) -> None:
        self.unresponsive.difference_update(node_ids)

    def missed(self, node_ids: Iterable[int]) -> None:
        self.unresponsive.update(node_ids)

    def expire(self, server_round: int) -> list[str]:
        """Forget client ids not heard from in the last ``identity.expire-rounds`` rounds
        (0: never); returns them (the engine drops their per-client tables)."""
        if not self.expire_rounds:
            return []
        gone = [c for c, seen in self.last_seen.items()
                if server_round - seen > self.expire_rounds]
        for client_id in gone:
            self.forget(client_id)
        return gone

    def forget(self, client_id: str) -> None:
        """``client_id`` is no longer known: not heard from, not identified, on no node."""
        self.last_seen.pop(client_id, None)
        self.client_info.pop(client_id, None)
        for node in [n for n, c in self.node_to_client.items() if c == client_id]:
            del self.node_to_client[node]

    def exclude(self, client_id: str) -> None:
        """Keep ``client_id`` out of training and evaluation sampling from now on."""
        self.excluded_clients.add(client_id)

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any]:
        """When each client id was last heard from (the rest is learnt again at the start:
        the nodes are asked who they are)."""
        return {"last_seen": self.last_seen}

    def restore(self, state: dict[str, Any]) -> None:
        self.last_seen = {client: int(seen)
                          for client, seen in state.get("last_seen", {}).items()}

    # ------------------------------------------------------------------ identify
    def identified(self, node_id: int, client_id: str, info: dict[str, Any]) -> None:
        """``node_id`` answered the identify query as ``client_id`` (its claim accepted)."""
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
        """Nodes that are not silent, not replaced, not refused and not of
        ``excluded_clients``, in client order (so sampling does not depend on node ids, which
        change between runs)."""
        ok = [n for n in nodes if n not in self.silent_nodes and n not in self.replaced_nodes
              and n not in self.refused_nodes
              and self.node_to_client.get(n) not in self.excluded_clients]

        def order(node: int) -> tuple[int, str]:
            client_id = self.node_to_client.get(node)
            return client_order(client_id) if client_id else (1 << 31, str(node))

        return sorted(ok, key=order)

    def nodes_of(self, clients: set[str]) -> list[int]:
        """The current nodes of ``clients``."""
        return [n for n, c in self.node_to_client.items()
                if c in clients and n not in self.replaced_nodes]


def wait_for_nodes(grid: Grid, nodes: NodeDirectory, min_nodes: int, timeout: float
                   ) -> list[int]:
    """The connected nodes (``nodes`` learns which are live and their registered names),
    once there are ``min_nodes`` of them.

    Waits at most ``timeout`` seconds: then it goes on with the nodes there are (a dead node
    must not stall the run), and fails with a clear error only if there are none."""
    deadline = time.monotonic() + timeout
    while True:
        connected = nodes.observe(grid.get_nodes())
        if len(connected) >= min_nodes:
            return connected
        if time.monotonic() >= deadline:
            if not connected:
                raise RuntimeError(f"no node connected within round-timeout ({timeout:.0f} s)")
            log(WARNING, "only %d of min-nodes=%d nodes connected after %.0f s; going on",
                len(connected), min_nodes, timeout)
            return connected
        log(INFO, "waiting for nodes: %d connected, min-nodes=%d", len(connected), min_nodes)
        time.sleep(1)
