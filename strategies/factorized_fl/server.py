"""Factorized-FL's server rule.

Per round, from one snapshot (this round's replies merged into each client's latest upload,
so absent clients still count and reply order does not matter): ``sigma_ik`` = cosine
similarity of the matching vectors of every pair of known clients; client ``k``'s weights are
``softmax(epsilon * sigma_ik)`` over the clients with ``sigma_ik >= tau`` (itself always
included, with ``sigma_kk = 1``, i.e. weight ``exp(epsilon)`` before normalising); client ``k``
receives its own weighted average of every shared array. A client never seen gets the plain
example-weighted average of the round's replies. The similarity matrix of each round is in
``results.json`` (``rounds[].similarity``: client ids and matrix).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from common.config import RunSettings
from common.protocol import ClientReply, client_order
from strategies.factorized_fl.spec import FactorsShared
from strategies.personalized import PersonalizedStrategy


def cosine_similarity(vectors: np.ndarray) -> np.ndarray:
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return unit @ unit.T


def matching_weights(vectors: dict[str, np.ndarray], tau: float, epsilon: float
                     ) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(client ids, similarity matrix, weight matrix): row ``k`` holds client ``k``'s
    aggregation weights over all clients (zero where ``sigma_ik < tau``)."""
    clients = sorted(vectors, key=client_order)
    similarity = cosine_similarity(np.stack([vectors[c].ravel() for c in clients]))
    np.fill_diagonal(similarity, 1.0)
    allowed = similarity >= tau
    np.fill_diagonal(allowed, True)
    logits = np.where(allowed, epsilon * similarity, -np.inf)
    logits -= logits.max(axis=1, keepdims=True)
    weights = np.exp(logits)
    return clients, similarity, weights / weights.sum(axis=1, keepdims=True)


class FactorizedFLStrategy(PersonalizedStrategy):
    checkpointed = (*PersonalizedStrategy.checkpointed, "latest", "personal")
    client_tables = (*PersonalizedStrategy.client_tables, "latest", "personal")
    wire: FactorsShared

    def __init__(self, settings: RunSettings, initial_arrays: ArrayRecord,
                 wire: FactorsShared) -> None:
        super().__init__(settings, initial_arrays, wire)
        self.match_key = wire.match_key
        self.tau = settings.method_settings.tau
        self.epsilon = settings.method_settings.epsilon
        self.latest: dict[str, dict[str, np.ndarray]] = {}
        self.personal: dict[str, ArrayRecord] = {}

    def aggregate_shared(self, server_round: int, replies: list[ClientReply],
                         arrays: ArrayRecord) -> ArrayRecord:
        for reply in replies:
            self.latest[reply.client_id] = {k: reply.arrays[k].numpy() for k in reply.arrays}
        clients, similarity, weights = matching_weights(
            {c: u[self.match_key] for c, u in self.latest.items()}, self.tau, self.epsilon)
        keys = list(self.shared_spec)
        for row, client in enumerate(clients):
            self.personal[client] = ArrayRecord({name: Array(sum(
                weights[row, col] * self.latest[other][name].astype(np.float64)
                for col, other in enumerate(clients) if weights[row, col] > 0
            ).astype(self.latest[client][name].dtype)) for name in keys})
        self.report(server_round, "similarity", {
            "clients": clients, "matrix": similarity.round(4).tolist(),
            "weights": weights.round(4).tolist()})
        return self.aggregate_keys(replies, keys, arrays)  # for clients not seen yet

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        return self.personal.get(client_id, arrays) if client_id is not None else arrays

    def state_tables(self) -> dict[str, Any]:
        return {"factorized-fl": {"known_clients": sorted(self.latest, key=client_order)}}
