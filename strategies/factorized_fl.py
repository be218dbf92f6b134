"""Factorized-FL: similarity-matched, per-client aggregation of the rank-1 factors.

What is shared (``factorized-fl.variant``):
- ``"u"`` (the paper's Factorized-FL): downlink and uplink carry every factorized layer's ``u``,
  the body's biases and BatchNorm affine parameters; the uplink adds the matching vector
  ``v`` of the last layer before the classifier. Every other ``v``, every ``mu``, BatchNorm
  running statistics and the classifier ``head`` stay on the client (the head is personal,
  as in the paper's permuted-label and multi-domain settings).
- ``"uvm"`` (the paper's Factorized-FL beta): ``u``, ``v`` and ``mu`` of every layer as well.

Server, per round, from one snapshot (this round's replies merged into each client's latest
upload, so absent clients still count and reply order does not matter): ``sigma_ik`` = cosine
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
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from torch import nn

from client_app.training.factorized_fl import train_factorized_fl
from common.config import RunSettings, in_range, one_of
from fldata import ClientData
from models.factorized_fl import factorize, factorized_layers, matching_key
from strategies.base import (
    NUM_EXAMPLES,
    ArraySpec,
    ClientReply,
    PersonalizedStrategy,
    client_order,
    spec_of,
)
from strategies.baselines import state_keys
from strategies.method import Method

VARIANTS = ("u", "uvm")


def shared_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    """The downlink: see the module docstring."""
    variant = settings.setting("factorized-fl.variant", str)
    private = ("head.", ) if variant == "uvm" else ("head.", *(
        f"{layer}.{factor}" for layer in factorized_layers(model) for factor in ("v", "mu")))
    return [k for k in state_keys(model)
            if not k.startswith(private) and "running_" not in k]


def with_matching_vector(model: nn.Module, keys: list[str], data: ClientData,
                         settings: RunSettings) -> list[str]:
    match = matching_key(model)
    return keys if match in keys else [*keys, match]


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

    def __init__(self, settings: RunSettings, initial_arrays: ArrayRecord) -> None:
        super().__init__(settings, initial_arrays)
        from strategies.registry import build_model  # the registry imports this module

        model = build_model(settings)
        self.match_key = matching_key(model)
        self.uplink_spec: ArraySpec = {
            **self.shared_spec,
            **spec_of(ArrayRecord({self.match_key: model.state_dict()[self.match_key]}))}
        self.tau = settings.setting("factorized-fl.tau")
        self.epsilon = settings.setting("factorized-fl.epsilon")
        self.latest: dict[str, dict[str, np.ndarray]] = {}
        self.personal: dict[str, ArrayRecord] = {}

    def expected_uplink(self, client_id: str, info: ConfigRecord) -> ArraySpec:
        return self.uplink_spec

    def aggregate_shared(self, server_round: int, replies: list[ClientReply],
                         arrays: ArrayRecord) -> ArrayRecord:
        for reply in replies:
            self.latest[reply.client_id] = {k: reply.arrays[k].numpy() for k in reply.arrays}
        clients, similarity, weights = matching_weights(
            {c: u[self.match_key] for c, u in self.latest.items()}, self.tau, self.epsilon)
        keys = list(self.shared_spec)
        for row, client in enumerate(clients):
            self.personal[client] = ArrayRecord({key: Array(sum(
                weights[row, col] * self.latest[other][key].astype(np.float64)
                for col, other in enumerate(clients) if weights[row, col] > 0
            ).astype(self.latest[client][key].dtype)) for key in keys})
        self._record(server_round).extra["similarity"] = {
            "clients": clients, "matrix": similarity.round(4).tolist(),
            "weights": weights.round(4).tolist()}
        plain = aggregate_arrayrecords([r.content for r in replies], NUM_EXAMPLES)
        return ArrayRecord({k: plain[k] for k in keys})

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        return self.personal.get(client_id, arrays) if client_id is not None else arrays

    def state_tables(self) -> dict[str, Any]:
        return {"factorized-fl": {"known_clients": sorted(self.latest, key=client_order)}}


def check(settings: RunSettings) -> None:
    one_of("factorized-fl.variant", settings.setting("factorized-fl.variant", str), VARIANTS)
    in_range("factorized-fl.tau", settings.setting("factorized-fl.tau"), -1, 1)
    in_range("factorized-fl.epsilon", settings.setting("factorized-fl.epsilon"), 0)
    in_range("factorized-fl.l1", settings.setting("factorized-fl.l1"), 0)


METHOD = Method("factorized-fl", FactorizedFLStrategy, train_factorized_fl, shared_keys,
                transform=factorize, validate=check, uplink_keys=with_matching_vector)
