"""FedFac's server rule: factor analysis splits elements into shared and personal.

For every layer in ``fedfac.layers`` (see ``models/fedfac.py``) the server stacks the replying
clients' matrices of that layer into ``Z`` (one column per element, one row per (client,
incoming weight) pair), takes the columns' correlation matrix ``R``, the number of factors
``G = min{m : top-m eigenvalues / all >= fedfac.kappa}``, and loadings ``A`` by principal-axis
factoring (loadings from the top ``G`` eigenpairs of ``R - Sigma_eps``,
``Sigma_eps = diag(R - A A^T)``, iterated until it settles; NumPy's ``eigh``). Element ``j`` is
shared when its communality ``nu_j = sum_m a_jm^2`` is at least the ``fedfac.tau-quantile``
quantile of ``nu`` (above 1: the whole layer is personal; below 0: all shared).

What is analysed (``fedfac.analysis``): ``"updates"`` (default), each client's weights minus
the shared weights the round started from (the server's; for a row that is already personal
in dynamic mode, its last shared value, so the difference is the client's drift since then);
``"weights"``, the weights themselves. Every client starts from one seeded initialisation, so
after a round or two of local training the weights are that initialisation plus small
updates, and their correlations are the initialisation's: a split of the weights is then
close to a random one. ``fedfac.warmup-rounds`` = W: rounds 1..W are FedAvg (everything
shared, no split); the first split is made from round W+1's replies.

``fedfac.mode = "static"``: split once, from the replies of the first round after the warm-up,
then fixed; afterwards personal elements never leave their clients (uplinks carry only the
shared rows). ``"dynamic"``: re-split every round from that round's replies, so clients upload
the analysed layers whole every round (the analysis needs them); personal rows are still never
averaged nor sent down.

Aggregation: shared elements of the analysed layers and every other shared key (FedAvg's keys)
are example-weighted means, applied with a global learning rate ``fedfac.server-lr``:
``w <- w + lr * (mean - w)``. Downlink: the analysed layers' shared rows plus the split as
``fedfac.mask.<layer>`` (uint8) arrays; clients put the shared rows in place and keep their own
personal rows. Per round, ``results.json`` has ``fedfac``: per layer the shared element
indices, counts, number of factors, the fraction of elements that kept their state from the
previous round, and the analysis time.
"""

from __future__ import annotations

import time
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import RunSettings
from common.protocol import (
    ACTION,
    ARRAYS,
    CONFIG,
    NUM_PARTITIONS,
    PARTITION_ID,
    TASK_ACCURACY,
    ClientReply,
    client_order,
)
from strategies.engine import Strategy
from strategies.engine.robust import combine
from strategies.fedfac.spec import MEMBER_PREFIX, FedFacSettings, SharedRows
from strategies.reference_splits import ReferenceSplit
from strategies.wire import Masks


# ---------------------------------------------------------------------- factor analysis
def element_correlation(weights: list[np.ndarray]) -> np.ndarray:
    """``R``: correlation between elements (columns) over (client, incoming weight) rows."""
    z = np.concatenate([w.reshape(w.shape[0], -1).T for w in weights]).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.corrcoef(z, rowvar=False)
    r = np.nan_to_num(np.atleast_2d(r))  # a constant element correlates with nothing
    np.fill_diagonal(r, 1.0)
    return r


def factor_count(eigenvalues: np.ndarray, kappa: float) -> int:
    """Smallest ``m`` whose top-``m`` eigenvalues hold a ``kappa`` share of the total."""
    values = np.sort(np.clip(eigenvalues, 0, None))[::-1]
    share = np.cumsum(values) / values.sum()
    return int(np.searchsorted(share, kappa - 1e-12) + 1)


def principal_axis_loadings(r: np.ndarray, num_factors: int, max_iter: int = 30,
                            tol: float = 1e-4, start: np.ndarray | None = None) -> np.ndarray:
    """Principal-axis factoring of a correlation matrix: loadings ``A`` (elements x G).

    Starts from the squared multiple correlations (the usual initial communalities); stops
    when no uniqueness moves by more than ``tol`` or after ``max_iter`` iterations (Heywood
    cases, where some uniqueness runs to 0, need not converge)."""
    uniqueness = (np.clip(1 / np.clip(np.diag(np.linalg.pinv(r)), 1.0, None), 0, 1)
                  if start is None else start.copy())
    for _ in range(max_iter):
        values, vectors = np.linalg.eigh(r - np.diag(uniqueness))
        top = np.argsort(values)[::-1][:num_factors]
        loadings = vectors[:, top] * np.sqrt(np.clip(values[top], 0, None))
        updated = np.clip(np.diag(r) - (loadings**2).sum(axis=1), 0, 1)
        if np.abs(updated - uniqueness).max() < tol:
            break
        uniqueness = updated
    return loadings


def shared_elements(weights: list[np.ndarray], kappa: float, tau_quantile: float,
                    start: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """(shared mask, communalities, number of factors) of one layer. ``start``: initial
    uniquenesses (dynamic mode passes the previous round's ``1 - nu``: a warm start)."""
    r = element_correlation(weights)
    num_factors = factor_count(np.linalg.eigvalsh(r), kappa)
    nu = (principal_axis_loadings(r, num_factors, start=start) ** 2).sum(axis=1)
    if tau_quantile > 1:
        return np.zeros(len(nu), bool), nu, num_factors
    if tau_quantile < 0:
        return np.ones(len(nu), bool), nu, num_factors
    return nu >= np.quantile(nu, tau_quantile), nu, num_factors


# ---------------------------------------------------------------------- server
AFTER_TRAINING = 0  # the ledger's record for replies after the last round (never a round)


class FedFacStrategy(Strategy[FedFacSettings]):
    checkpointed = ("split", "communalities")
    wire: SharedRows

    def __init__(self, settings: RunSettings[FedFacSettings], initial_arrays: ArrayRecord,
                 wire: SharedRows) -> None:
        super().__init__(settings, initial_arrays, wire)
        options = settings.method_settings
        self.layers = wire.layers
        self.layer_of_key = wire.layer_of_key
        self.static = wire.static
        self.kappa = options.kappa
        self.tau_quantile = options.tau_quantile
        self.server_lr = options.server_lr
        self.on_updates = options.analysis == "updates"
        self.warmup_rounds = options.warmup_rounds
        self.split: dict[str, np.ndarray] | None = None
        self.communalities: dict[str, np.ndarray] = {}  # last analysis (warm start)
        self.reference = ReferenceSplit(settings, self.layers[0],
                                        wire.shared_spec[f"{self.layers[0]}.weight"][0][0])
        self.sliced_uplink = False  # whether this round's clients send only shared rows

    def begin_round(self, server_round: int) -> None:
        self.sliced_uplink = self.static and self.split is not None

    def uplink_masks(self) -> Masks | None:
        return self.split if self.sliced_uplink else None

    def analysed_matrices(self, layer: str, replies: list[ClientReply],
                          arrays: ArrayRecord) -> list[np.ndarray]:
        """Per client, the layer's weight (``fedfac.analysis = "weights"``) or its update, the
        weight minus the round's starting shared weight (``"updates"``)."""
        key = f"{layer}.weight"
        weights = [r.arrays[key].numpy() for r in replies]
        if not self.on_updates:
            return weights
        start = arrays[key].numpy().astype(np.float64)
        return [w.astype(np.float64) - start for w in weights]

    def _analyse(self, server_round: int, replies: list[ClientReply],
                 arrays: ArrayRecord) -> None:
        report: dict[str, Any] = {}
        split: dict[str, np.ndarray] = {}
        for layer in self.layers:
            start = time.perf_counter()
            previous = self.communalities.get(layer)
            mask, nu, factors = shared_elements(
                self.analysed_matrices(layer, replies, arrays), self.kappa,
                self.tau_quantile, None if previous is None else np.clip(1 - previous, 0, 1))
            self.communalities[layer] = nu
            mask = self.reference.apply(server_round, layer, mask)  # benchmarks only
            kept = None if self.split is None else float((self.split[layer] == mask).mean())
            split[layer] = mask
            report[layer] = {"shared": np.flatnonzero(mask).tolist(),
                             "num_shared": int(mask.sum()), "num_elements": len(mask),
                             "num_factors": factors, "kept_fraction": kept,
                             "communalities": np.round(nu, 4).tolist(),
                             "analysis_seconds": time.perf_counter() - start,
                             **self.reference.overlap(layer, mask)}
        self.split = split
        self.report(server_round, "fedfac", report)

    def aggregate_train(self, server_round: int, replies: list[ClientReply],
                        arrays: ArrayRecord) -> ArrayRecord:
        if server_round > self.warmup_rounds and (self.split is None or not self.static):
            self._analyse(server_round, replies, arrays)
        rows = {key: slice(None) if key not in self.layer_of_key or self.split is None
                else self.split[self.layer_of_key[key]] for key in arrays}
        cut = {key: slice(None) if self.sliced_uplink else rows[key] for key in rows}
        old = {key: value.numpy() for key, value in arrays.items()}
        # the shared rows by the run's aggregation rule (default: example-weighted mean)
        mean = combine([{k: r.arrays[k].numpy()[cut[k]] for k in rows} for r in replies],
                       [r.num_examples for r in replies],
                       {k: old[k][rows[k]] for k in rows}, self.settings)
        merged = {}
        for key, current in old.items():
            new = current.astype(np.float64).copy()
            new[rows[key]] = new[rows[key]] + self.server_lr * (mean[key] - new[rows[key]])
            merged[key] = Array(new.astype(current.dtype))
        return ArrayRecord(merged)

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        return arrays if self.split is None else self.wire.pack_downlink(arrays, self.split)

    # ------------------------------------------------------------------ new clients
    def on_identified(self, client_id: str, info: dict[str, Any]) -> None:
        """Hold the last ``fedfac.new-clients`` fraction of partitions out of training."""
        fraction = self.settings.method_settings.new_clients
        total = int(info[NUM_PARTITIONS])
        held_out = max(1, round(fraction * total)) if fraction > 0 else 0
        excluded = self.nodes.excluded_clients
        if int(info[PARTITION_ID]) >= total - held_out and client_id not in excluded:
            excluded.add(client_id)
            log(INFO, "fedfac: new client %s held out of training", client_id)

    def after_training(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        """Table 3 of the paper: new clients with LocalTrain and with Ensemble."""
        excluded = self.nodes.excluded_clients
        if not excluded or self.split is None:
            return None
        existing = set(self.nodes.client_info) - excluded
        # replies are validated like every other (dropped ones: under new_clients.dropped)
        personal_spec = {k: self.wire.shared_spec[k] for k in self.wire.always_personal}
        personal = self.replies.valid(AFTER_TRAINING, "fedfac.personal", self.messenger.query(
            grid, {n: RecordDict({CONFIG: ConfigRecord({ACTION: "fedfac.personal"})})
                   for n in self.nodes.nodes_of(existing)}), None, lambda _: personal_spec)
        downlink = self.downlink(0, None, arrays)
        members = dict(arrays.items())
        for i, reply in enumerate(personal):
            for key, value in reply.arrays.items():
                shared = self.split[self.layer_of_key[key]]
                own = value.numpy().copy()
                own[shared] = arrays[key].numpy()[shared]  # the final shared rows
                members[f"{MEMBER_PREFIX}{i}.{key}"] = Array(own)
        new_nodes = self.nodes.nodes_of(excluded)
        report: dict[str, Any] = {"clients": sorted(excluded, key=client_order),
                                  "ensemble_members": len(personal)}
        for action, payload in (("fedfac.localtrain", downlink),
                                ("fedfac.ensemble", ArrayRecord(members))):
            batch = self.messenger.query(grid, {n: RecordDict(
                {ARRAYS: payload, CONFIG: ConfigRecord({ACTION: action})}) for n in new_nodes})
            valid = self.replies.valid(AFTER_TRAINING, action, batch,
                                       ("accuracy", TASK_ACCURACY))
            per_client = {r.client_id: float(r.metrics["accuracy"]) for r in valid}
            name = action.split(".")[1]
            report[name] = {"per_client": per_client,
                            "accuracy_mean": float(np.mean(list(per_client.values())))
                            if per_client else None,
                            "accuracy_task_mean": float(np.mean(
                                [float(r.metrics[TASK_ACCURACY]) for r in valid]))
                            if valid else None}
        if self.ledger.record(AFTER_TRAINING).dropped:
            report["dropped"] = self.ledger.record(AFTER_TRAINING).dropped
        log(INFO, "fedfac new clients: LocalTrain %s, Ensemble %s",
            report["localtrain"]["accuracy_mean"], report["ensemble"]["accuracy_mean"])
        return {"new_clients": report}

    def state_tables(self) -> dict[str, Any]:
        return {"fedfac": {"split": None if self.split is None else {
            layer: np.flatnonzero(mask).tolist() for layer, mask in self.split.items()}}}


