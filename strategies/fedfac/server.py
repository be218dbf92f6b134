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
are merged by the run's rule, as every method's (``RuleContext.aggregate``: the
``aggregation.*`` rule, by default the example-weighted mean, in float64), applied with a
global learning rate ``fedfac.server-lr``: ``w <- w + lr * (mean - w)``. Downlink: the
analysed layers' shared rows plus the split as ``fedfac.mask.<layer>`` (uint8) arrays; clients
put the shared rows in place and keep their own personal rows. Per round, ``results.json``
has ``fedfac``: per layer the shared element indices, counts, number of factors, the fraction
of elements that kept their state from the previous round, and the analysis time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from logging import INFO
from typing import Any, TypedDict

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import RunSettings
from common.protocol import (
    NUM_PARTITIONS,
    PARTITION_ID,
    TASK_ACCURACY,
    ClientReply,
    client_order,
)
from fldata import synthetic_generator
from strategies.engine import AFTER_TRAINING, MethodRule, RuleContext
from strategies.fedfac.spec import MEMBER_PREFIX, FedFacSettings, SharedRows
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


# ---------------------------------------------------------------------- reference splits
# The ``fedfac.split`` option, to measure FedFac's own split against others.
# FedFac's split claim (the estimated split beats a random one of the same size) needs
# splits to compare with: ``true``, the synthetic generator's own split of the first analysed
# layer's units (``dataset = "synthetic-fedfac"`` only), and ``random``, as many shared
# elements as FedFac estimated, drawn at random (seeded by the run's seed and the round).
# ``estimate`` (the default) is FedFac itself: the estimate goes through unchanged. The
# key and its check are declared with the other FedFac keys (``spec.py``). On the synthetic
# data, the report also says how much of the true split the estimate found.
SYNTHETIC = "synthetic-fedfac"


class ReferenceSplit:
    def __init__(self, settings: RunSettings[FedFacSettings], first_layer: str,
                 num_units: int) -> None:
        self.kind = settings.method_settings.split
        self.seed = settings.seed
        self.first_layer = first_layer
        self.true_shared: np.ndarray | None = None
        if settings.dataset == SYNTHETIC:
            true = synthetic_generator(settings).true_shared_units()
            if len(true) == num_units:  # the generator's units are the layer's elements
                self.true_shared = true

    def apply(self, server_round: int, layer: str, estimated: np.ndarray) -> np.ndarray:
        """The split to use for ``layer`` in place of FedFac's ``estimated`` one."""
        if self.kind == "true" and layer == self.first_layer:
            return self.true_shared.copy()
        if self.kind == "random":
            rng = np.random.default_rng([self.seed, server_round])
            mask = np.zeros_like(estimated)
            mask[rng.choice(len(mask), int(estimated.sum()), replace=False)] = True
            return mask
        return estimated

    def overlap(self, layer: str, mask: np.ndarray) -> dict[str, Any]:
        """``true_overlap``: the share of the true shared units in ``mask`` (synthetic data,
        first analysed layer), for the per-round report."""
        if self.true_shared is None or layer != self.first_layer:
            return {}
        return {"true_overlap": float((mask & self.true_shared).sum()
                                      / max(self.true_shared.sum(), 1))}


# ---------------------------------------------------------------------- server
class FedFacState(TypedDict):
    """What the checkpoint keeps of FedFac's server: the split (None: not made yet) and the
    last analysis's communalities (dynamic mode's warm start), per analysed layer."""

    split: dict[str, np.ndarray] | None
    communalities: dict[str, np.ndarray]


class FedFacRule(MethodRule[FedFacSettings]):
    wire: SharedRows

    def __init__(self, run: RuleContext[FedFacSettings]) -> None:
        super().__init__(run)
        self.options = self.settings.method_settings
        self.split: dict[str, np.ndarray] | None = None
        self.communalities: dict[str, np.ndarray] = {}  # last analysis (warm start)
        first = self.wire.layers[0]
        self.reference = ReferenceSplit(self.settings, first,
                                        self.wire.shared_spec[f"{first}.weight"][0][0])

    def state(self) -> FedFacState:
        return {"split": self.split, "communalities": self.communalities}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.split = None if state["split"] is None else dict(state["split"])
        self.communalities = dict(state["communalities"])

    def sliced_uplink(self) -> bool:
        """Whether the clients send only the shared rows: in static mode, once the split is
        made (the replies of the round that makes it are whole)."""
        return self.wire.static and self.split is not None

    def uplink_rows(self) -> Masks | None:
        return self.split if self.sliced_uplink() else None

    def analysed_matrices(self, layer: str, replies: list[ClientReply],
                          arrays: ArrayRecord) -> list[np.ndarray]:
        """Per client, the layer's weight (``fedfac.analysis = "weights"``) or its update, the
        weight minus the round's starting shared weight (``"updates"``)."""
        key = f"{layer}.weight"
        weights = [r.arrays[key].numpy() for r in replies]
        if self.options.analysis != "updates":
            return weights
        start = arrays[key].numpy().astype(np.float64)
        return [w.astype(np.float64) - start for w in weights]

    def _analyse(self, server_round: int, replies: list[ClientReply],
                 arrays: ArrayRecord) -> None:
        report: dict[str, Any] = {}
        split: dict[str, np.ndarray] = {}
        for layer in self.wire.layers:
            start = time.perf_counter()
            previous = self.communalities.get(layer)
            mask, nu, factors = shared_elements(
                self.analysed_matrices(layer, replies, arrays), self.options.kappa,
                self.options.tau_quantile,
                None if previous is None else np.clip(1 - previous, 0, 1))
            self.communalities[layer] = nu
            mask = self.reference.apply(server_round, layer, mask)  # fedfac.split
            kept = None if self.split is None else float((self.split[layer] == mask).mean())
            split[layer] = mask
            report[layer] = {"shared": np.flatnonzero(mask).tolist(),
                             "num_shared": int(mask.sum()), "num_elements": len(mask),
                             "num_factors": factors, "kept_fraction": kept,
                             "communalities": np.round(nu, 4).tolist(),
                             "analysis_seconds": time.perf_counter() - start,
                             **self.reference.overlap(layer, mask)}
        self.split = split
        self.run.report(server_round, "fedfac", report)

    def merge_updates(self, server_round: int, replies: list[ClientReply],
                      arrays: ArrayRecord) -> ArrayRecord:
        sliced = self.sliced_uplink()  # what these replies carry: decided before a new split
        if server_round > self.options.warmup_rounds and (self.split is None
                                                          or not self.wire.static):
            self._analyse(server_round, replies, arrays)
        layer_of_key = self.wire.layer_of_key
        rows = {key: slice(None) if key not in layer_of_key or self.split is None
                else self.split[layer_of_key[key]] for key in arrays}
        cut = {key: slice(None) if sliced else rows[key] for key in rows}
        old = {key: value.numpy() for key, value in arrays.items()}
        # the shared rows by the run's aggregation rule (default: example-weighted mean), in
        # float64: the server's learning rate goes on from the unrounded mean
        shared = [replace(r, arrays=ArrayRecord({k: Array(r.arrays[k].numpy()[cut[k]])
                                                 for k in rows})) for r in replies]
        mean = self.run.aggregate(shared, list(rows), ArrayRecord(
            {k: Array(old[k][rows[k]]) for k in rows}), dtype=np.dtype(np.float64))
        merged = {}
        server_lr = self.options.server_lr
        for key, current in old.items():
            new = current.astype(np.float64).copy()
            new[rows[key]] = new[rows[key]] + server_lr * (mean[key].numpy()
                                                           - new[rows[key]])
            merged[key] = Array(new.astype(current.dtype))
        return ArrayRecord(merged)

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        return arrays if self.split is None else self.wire.pack_downlink(arrays, self.split)

    # ------------------------------------------------------------------ new clients
    def client_identified(self, client_id: str, info: dict[str, Any]) -> None:
        """Hold the last ``fedfac.new-clients`` fraction of partitions out of training."""
        fraction = self.options.new_clients
        total = int(info[NUM_PARTITIONS])
        held_out = max(1, round(fraction * total)) if fraction > 0 else 0
        if int(info[PARTITION_ID]) >= total - held_out and client_id not in self.run.held_out():
            self.run.hold_out(client_id)
            log(INFO, "fedfac: new client %s held out of training", client_id)

    def after_last_round(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        """Table 3 of the paper: new clients with LocalTrain and with Ensemble."""
        new_clients = self.run.held_out()
        if not new_clients or self.split is None:
            return None
        personal = self.personal_parts(grid, self.run.known_clients() - new_clients)
        members = self.ensemble(arrays, personal)
        report: dict[str, Any] = {"clients": sorted(new_clients, key=client_order),
                                  "ensemble_members": len(personal)}
        for action, payload in (("fedfac.localtrain", self.downlink(0, None, arrays)),
                                ("fedfac.ensemble", members)):
            report[action.split(".")[1]] = self.new_client_accuracy(grid, action, payload,
                                                                   new_clients)
        report.update(self.run.traffic(AFTER_TRAINING))  # bytes both ways, dropped replies
        log(INFO, "fedfac new clients: LocalTrain %s, Ensemble %s",
            report["localtrain"]["accuracy_mean"], report["ensemble"]["accuracy_mean"])
        return {"new_clients": report}

    def personal_parts(self, grid: Grid, clients: set[str]) -> list[ClientReply]:
        """The existing clients' personal rows of the analysed layers (validated like any
        reply; dropped ones are reported under ``new_clients.dropped``)."""
        personal_spec = {k: self.wire.shared_spec[k] for k in self.wire.always_personal}
        return self.run.query(grid, "fedfac.personal", clients, None, None,
                              lambda _: personal_spec)

    def ensemble(self, arrays: ArrayRecord, personal: list[ClientReply]) -> ArrayRecord:
        """The final shared arrays, and one member per existing client: its personal rows
        with the final shared rows in place."""
        members = dict(arrays.items())
        for i, reply in enumerate(personal):
            for key, value in reply.arrays.items():
                shared = self.split[self.wire.layer_of_key[key]]
                own = value.numpy().copy()
                own[shared] = arrays[key].numpy()[shared]
                members[f"{MEMBER_PREFIX}{i}.{key}"] = Array(own)
        return ArrayRecord(members)

    def new_client_accuracy(self, grid: Grid, action: str, payload: ArrayRecord,
                            new_clients: set[str]) -> dict[str, Any]:
        """The new clients' accuracies after ``action`` (LocalTrain or Ensemble)."""
        valid = self.run.query(grid, action, new_clients, payload, ("accuracy", TASK_ACCURACY))
        per_client = {r.client_id: float(r.metrics["accuracy"]) for r in valid}
        return {"per_client": per_client,
                "accuracy_mean": float(np.mean(list(per_client.values())))
                if per_client else None,
                "accuracy_task_mean": float(np.mean(
                    [float(r.metrics[TASK_ACCURACY]) for r in valid])) if valid else None}

    def results_tables(self) -> dict[str, Any]:
        return {"fedfac": {"split": None if self.split is None else {
            layer: np.flatnonzero(mask).tolist() for layer, mask in self.split.items()}}}
