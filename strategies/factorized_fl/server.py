"""Factorized-FL's server rule.

Per round, from one snapshot (this round's replies merged into each client's latest upload,
so absent clients still count and reply order does not matter): ``sigma_ik`` = cosine
similarity of the matching vectors of every pair of known clients; client ``k``'s weights are
``softmax(epsilon * sigma_ik)`` over the clients with ``sigma_ik >= tau`` (itself always
included, with ``sigma_kk = 1``, i.e. weight ``exp(epsilon)`` before normalising), and, when
fewer than ``factorized-fl.min-aggregated = n`` pass ``tau``, over its ``n`` most similar
clients instead (itself and its ``n - 1`` nearest; the authors' ``minimum_aggr``, e.g. 4 in
their multi-domain setting; ``n = 1``: only itself is guaranteed); client ``k`` receives its
own weighted average of every shared array. A client never seen gets the plain
example-weighted average of the round's replies. The similarity and weight matrices of each
round are in ``results.json`` (``rounds[].similarity``: client ids and matrices; above
``MATRIX_IN_RESULTS`` clients a summary: mean off-diagonal similarity and mean number of
clients each average is taken over).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np
from flwr.app import Array, ArrayRecord

from common.protocol import ClientReply, client_order
from models.factorized_fl import MU_DENSITY
from strategies.engine import MethodRule, RuleContext
from strategies.factorized_fl.spec import FactorizedFLSettings, FactorsShared


def cosine_similarity(vectors: np.ndarray) -> np.ndarray:
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return unit @ unit.T


def matching_weights(vectors: dict[str, np.ndarray], tau: float, epsilon: float,
                     min_aggregated: int = 1) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(client ids, similarity matrix, weight matrix): row ``k`` holds client ``k``'s
    aggregation weights over all clients: ``softmax(epsilon * sigma_ki)`` over the clients
    with ``sigma_ki >= tau``, itself and its ``min_aggregated - 1`` most similar others (ties:
    the earlier client id), zero elsewhere."""
    clients = sorted(vectors, key=client_order)
    similarity = cosine_similarity(np.stack([vectors[c].ravel() for c in clients]))
    np.fill_diagonal(similarity, 1.0)
    allowed = similarity >= tau
    np.fill_diagonal(allowed, True)
    if min_aggregated > 1:  # the top-n of each row, itself first
        ranked = np.where(np.eye(len(clients), dtype=bool), np.inf, similarity)
        nearest = np.argsort(-ranked, axis=1, kind="stable")[:, :min_aggregated]
        np.put_along_axis(allowed, nearest, True, axis=1)
    logits = np.where(allowed, epsilon * similarity, -np.inf)
    logits -= logits.max(axis=1, keepdims=True)
    weights = np.exp(logits)
    return clients, similarity, weights / weights.sum(axis=1, keepdims=True)


# Up to this many known clients a round's entry in results.json holds the whole similarity
# and weight matrices; above it a summary. The matrices grow as the square of the clients and
# results.json is rewritten every round: at 100 clients they added 0.4 MB a round, and writing
# the file came to take most of a 160-round run's time.
MATRIX_IN_RESULTS = 20


class FactorizedFLState(TypedDict):
    """What the checkpoint keeps of Factorized-FL's server: each client id's latest upload."""

    latest: dict[str, dict[str, np.ndarray]]


class FactorizedFLRule(MethodRule[FactorizedFLSettings]):
    """Per round the similarities and weights of all known clients (one matrix product), but
    a client's weighted average only when it is sent to that client (``downlink``): with 1,000
    clients and ``fraction-train = 0.1`` that is 100 rows of work instead of 1,000, and no
    table of personal models. Every average is taken over the same snapshot as before
    (``latest`` changes only in ``merge_updates``), so what a client receives is the same."""

    wire: FactorsShared

    def __init__(self, run: RuleContext[FactorizedFLSettings]) -> None:
        super().__init__(run)
        self.latest: dict[str, dict[str, np.ndarray]] = {}
        self._snapshot: tuple[dict[str, int], np.ndarray] | None = None  # rows, weights
        self._stacked: dict[str, np.ndarray] = {}  # key -> (clients, size), this snapshot
        self._personal: dict[str, ArrayRecord] = {}  # downlinks built from this snapshot

    def state(self) -> FactorizedFLState:
        return {"latest": self.latest}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.latest = dict(state["latest"])

    def forget(self, client_id: str) -> None:
        self.latest.pop(client_id, None)

    def merge_updates(self, server_round: int, replies: list[ClientReply],
                      arrays: ArrayRecord) -> ArrayRecord:
        for reply in replies:
            self.latest[reply.client_id] = {k: reply.arrays[k].numpy() for k in reply.arrays}
        clients, similarity, weights = self._match()
        if len(clients) <= MATRIX_IN_RESULTS:
            report: dict[str, Any] = {"clients": clients,
                                      "matrix": similarity.round(4).tolist(),
                                      "weights": weights.round(4).tolist()}
        else:
            off = similarity[~np.eye(len(clients), dtype=bool)]
            report = {"num_clients": len(clients), "mean": round(float(off.mean()), 4),
                      "neighbours_mean": float((weights > 0).sum(axis=1).mean())}
        self.run.report(server_round, "similarity", report)
        densities = [(float(r.metrics[MU_DENSITY]), r.num_examples) for r in replies
                     if MU_DENSITY in r.metrics]  # withheld under local DP
        if densities:
            self.run.report(server_round, "mu_density", sum(d * n for d, n in densities)
                            / sum(n for _, n in densities))
        return self.run.aggregate(replies, list(self.wire.shared_spec), arrays)  # new clients

    def _match(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Similarities and weights of the current snapshot; forgets the downlinks built from
        the previous one."""
        options = self.settings.method_settings
        clients, similarity, weights = matching_weights(
            {c: u[self.wire.match_key] for c, u in self.latest.items()}, options.tau,
            options.epsilon, options.min_aggregated)
        self._snapshot = ({c: i for i, c in enumerate(clients)}, weights)
        self._stacked, self._personal = {}, {}
        return clients, similarity, weights

    def tables_changed(self) -> None:
        """Restored uploads, or an expired client gone from them: a new snapshot."""
        if self.latest:
            self._match()
        else:
            self._snapshot, self._stacked, self._personal = None, {}, {}

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        if self._snapshot is None or client_id not in self._snapshot[0]:
            return arrays  # not seen yet: the example-weighted average
        if client_id not in self._personal:
            rows, weights = self._snapshot
            order = list(rows)
            row = weights[rows[client_id]]
            for name in self.wire.shared_spec:
                if name not in self._stacked:
                    self._stacked[name] = np.stack([self.latest[c][name].astype(np.float64)
                                                    .ravel() for c in order])
            own = self.latest[client_id]
            self._personal[client_id] = ArrayRecord({name: Array(
                (row @ self._stacked[name]).reshape(own[name].shape).astype(own[name].dtype))
                for name in self.wire.shared_spec})
        return self._personal[client_id]

    def results_tables(self) -> dict[str, Any]:
        return {"factorized-fl": {"known_clients": sorted(self.latest, key=client_order)}}
