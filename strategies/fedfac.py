"""FedFac / FedSplit (Wang, Tang, Li): factor analysis splits elements into shared and personal.

For every layer in ``fedfac.layers`` (see ``models/fedfac.py``) the server stacks the replying
clients' weights of that layer into ``Z`` (one column per element, one row per (client,
incoming weight) pair), takes the columns' correlation matrix ``R``, the number of factors
``G = min{m : top-m eigenvalues / all >= fedfac.kappa}``, and loadings ``A`` by principal-axis
factoring (loadings from the top ``G`` eigenpairs of ``R - Sigma_eps``,
``Sigma_eps = diag(R - A A^T)``, iterated until it settles; NumPy's ``eigh``). Element ``j`` is
shared when its communality ``nu_j = sum_m a_jm^2`` is at least the ``fedfac.tau-quantile``
quantile of ``nu`` (above 1: the whole layer is personal; below 0: all shared).

``fedfac.mode = "static"``: split once, from the weights after the first local training, then
fixed; afterwards personal elements never leave their clients (uplinks carry only the shared
rows). ``"dynamic"``: re-split every round from that round's replies, so clients upload the
analysed layers whole every round (the analysis needs them); personal rows are still never
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
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from torch import Tensor, nn

from client_app.training.baselines import train_everything
from client_app.training.fedfac import ACTIONS, MEMBER_PREFIX
from common.config import ConfigError, RunSettings, in_range, one_of
from models.fedfac import analysed_layers, element_keys
from strategies.base import ArraySpec, ClientReply, PersonalizedStrategy, client_order
from strategies.baselines import all_keys
from strategies.method import Method, overlay

MASK_PREFIX = "fedfac.mask."


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
class FedFacStrategy(PersonalizedStrategy):
    checkpointed = (*PersonalizedStrategy.checkpointed, "split", "communalities")

    def __init__(self, settings: RunSettings, initial_arrays: ArrayRecord) -> None:
        super().__init__(settings, initial_arrays)
        from strategies.registry import build_model  # the registry imports this module

        model = build_model(settings)
        self.layers = analysed_layers(model, settings.setting("fedfac.layers", str))
        self.layer_of_key = {k: layer for layer in self.layers
                             for k in element_keys(model, layer)}
        self.static = settings.setting("fedfac.mode", str) == "static"
        self.kappa = settings.setting("fedfac.kappa")
        self.tau_quantile = settings.setting("fedfac.tau-quantile")
        self.server_lr = settings.setting("fedfac.server-lr", float, 1.0)
        self.split: dict[str, np.ndarray] | None = None
        self.communalities: dict[str, np.ndarray] = {}  # last analysis (warm start)
        self.reference = settings.setting("fedfac.split", str, "estimate")
        self.true_shared = None
        if settings.dataset == "synthetic-fedfac":
            from fldata import synthetic_generator

            true = synthetic_generator(settings).true_shared_units()
            if len(true) == model.get_submodule(self.layers[0]).weight.shape[0]:
                self.true_shared = true
        self.sliced_uplink = False  # whether this round's clients send only shared rows

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> list[Message]:
        self.sliced_uplink = self.static and self.split is not None
        return super().configure_train(server_round, arrays, config, grid)

    def expected_uplink(self, client_id: str, info: ConfigRecord) -> ArraySpec:
        if not self.sliced_uplink:
            return self.shared_spec
        spec = dict(self.shared_spec)
        for key, layer in self.layer_of_key.items():
            shape, dtype = spec[key]
            spec[key] = ((int(self.split[layer].sum()), *shape[1:]), dtype)
        return spec

    def _analyse(self, server_round: int, replies: list[ClientReply]) -> None:
        report: dict[str, Any] = {}
        split: dict[str, np.ndarray] = {}
        for layer in self.layers:
            start = time.perf_counter()
            previous = self.communalities.get(layer)
            mask, nu, factors = shared_elements(
                [r.arrays[f"{layer}.weight"].numpy() for r in replies], self.kappa,
                self.tau_quantile, None if previous is None else np.clip(1 - previous, 0, 1))
            self.communalities[layer] = nu
            mask = self._reference_split(server_round, layer, mask)
            kept = None if self.split is None else float((self.split[layer] == mask).mean())
            split[layer] = mask
            report[layer] = {"shared": np.flatnonzero(mask).tolist(),
                             "num_shared": int(mask.sum()), "num_elements": len(mask),
                             "num_factors": factors, "kept_fraction": kept,
                             "communalities": np.round(nu, 4).tolist(),
                             "analysis_seconds": time.perf_counter() - start}
            if self.true_shared is not None and layer == self.layers[0]:
                report[layer]["true_overlap"] = float(
                    (mask & self.true_shared).sum() / max(self.true_shared.sum(), 1))
        self.split = split
        self._record(server_round).extra["fedfac"] = report

    def _reference_split(self, server_round: int, layer: str, estimated: np.ndarray
                         ) -> np.ndarray:
        """``fedfac.split``: ``estimate`` (FedFac), or a reference for benchmarks: ``true``
        (the synthetic generator's split of the first analysed layer's units) or ``random``
        (as many shared elements as estimated, chosen at random; seeded)."""
        if self.reference == "true" and layer == self.layers[0]:
            return self.true_shared.copy()
        if self.reference == "random":
            rng = np.random.default_rng([self.settings.seed, server_round])
            mask = np.zeros_like(estimated)
            mask[rng.choice(len(mask), int(estimated.sum()), replace=False)] = True
            return mask
        return estimated

    def aggregate_shared(self, server_round: int, replies: list[ClientReply],
                         arrays: ArrayRecord) -> ArrayRecord:
        if self.split is None or not self.static:
            self._analyse(server_round, replies)
        total = sum(r.num_examples for r in replies)
        merged = {}
        for key, current in arrays.items():
            old = current.numpy()
            layer = self.layer_of_key.get(key)
            rows = (slice(None) if layer is None else self.split[layer])
            uploads = [r.arrays[key].numpy() for r in replies]
            if layer is not None and not self.sliced_uplink:
                uploads = [u[rows] for u in uploads]
            mean = sum(u.astype(np.float64) * (r.num_examples / total)
                       for u, r in zip(uploads, replies, strict=True))
            new = old.astype(np.float64).copy()
            new[rows] = new[rows] + self.server_lr * (mean - new[rows])
            merged[key] = Array(new.astype(old.dtype))
        return ArrayRecord(merged)

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        if self.split is None:
            return arrays
        out = {key: (Array(value.numpy()[self.split[self.layer_of_key[key]]])
                     if key in self.layer_of_key else value) for key, value in arrays.items()}
        for layer, mask in self.split.items():
            out[f"{MASK_PREFIX}{layer}"] = Array(mask.astype(np.uint8))
        return ArrayRecord(out)

    # ------------------------------------------------------------------ new clients
    def on_identified(self, client_id: str, info: dict[str, Any]) -> None:
        """Hold the last ``fedfac.new-clients`` fraction of partitions out of training."""
        fraction = self.settings.setting("fedfac.new-clients", float, 0.0)
        total = int(info["num-partitions"])
        held_out = max(1, round(fraction * total)) if fraction > 0 else 0
        if int(info["partition-id"]) >= total - held_out and client_id not in self.excluded_clients:
            self.excluded_clients.add(client_id)
            log(INFO, "fedfac: new client %s held out of training", client_id)

    def _nodes_of(self, clients: set[str]) -> list[int]:
        return [n for n, c in self.node_to_client.items()
                if c in clients and n not in self.replaced_nodes]

    def after_training(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        """Table 3 of the paper: new clients with LocalTrain and with Ensemble."""
        if not self.excluded_clients or self.split is None:
            return None
        existing = set(self.client_info) - self.excluded_clients
        personal = [r for r in self.query(grid, {n: RecordDict({"config": ConfigRecord(
            {"action": "fedfac.personal"})}) for n in self._nodes_of(existing)})
            if not r.has_error()]
        downlink = self.downlink(0, None, arrays)
        members = dict(arrays.items())
        for i, reply in enumerate(personal):
            for key, value in reply.content["arrays"].items():
                shared = self.split[self.layer_of_key[key]]
                own = value.numpy().copy()
                own[shared] = arrays[key].numpy()[shared]  # the final shared rows
                members[f"{MEMBER_PREFIX}{i}.{key}"] = Array(own)
        new_nodes = self._nodes_of(self.excluded_clients)
        report: dict[str, Any] = {"clients": sorted(self.excluded_clients, key=client_order),
                                  "ensemble_members": len(personal)}
        for action, payload in (("fedfac.localtrain", downlink),
                                ("fedfac.ensemble", ArrayRecord(members))):
            replies = self.query(grid, {n: RecordDict({"arrays": payload, "config": ConfigRecord(
                {"action": action})}) for n in new_nodes})
            per_client = {str(r.content["client"]["client-id"]):
                          float(r.content["metrics"]["accuracy"])
                          for r in replies if not r.has_error()}
            name = action.split(".")[1]
            report[name] = {"per_client": per_client,
                            "accuracy_mean": float(np.mean(list(per_client.values())))
                            if per_client else None}
        log(INFO, "fedfac new clients: LocalTrain %s, Ensemble %s",
            report["localtrain"]["accuracy_mean"], report["ensemble"]["accuracy_mean"])
        return {"new_clients": report}

    def state_tables(self) -> dict[str, Any]:
        return {"fedfac": {"split": None if self.split is None else {
            layer: np.flatnonzero(mask).tolist() for layer, mask in self.split.items()}}}


# ---------------------------------------------------------------------- client side
def _masks(incoming: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k[len(MASK_PREFIX):]: v.bool() for k, v in incoming.items()
            if k.startswith(MASK_PREFIX)}


def _layer_of(key: str, masks: dict[str, Tensor], model_keys: dict[str, str]) -> str | None:
    layer = model_keys.get(key)
    return layer if layer in masks else None


def merge_shared_rows(model: nn.Module, own: dict[str, Tensor], incoming: dict[str, Tensor],
                      settings: RunSettings) -> dict[str, Tensor]:
    """Shared rows from the server into this client's own tensors; personal rows stay."""
    masks = _masks(incoming)
    layer_of_key = _element_layers(model, settings)
    merged = dict(own)
    plain = {}
    for key, value in incoming.items():
        if key.startswith(MASK_PREFIX):
            continue
        layer = _layer_of(key, masks, layer_of_key)
        if layer is None:
            plain[key] = value
            continue
        rows = masks[layer]
        if key not in own or value.shape != (int(rows.sum()), *own[key].shape[1:]):
            raise ValueError(f"received array {key!r} does not fit the shared rows")
        merged[key] = own[key].clone()
        merged[key][rows] = value
    return overlay(model, merged, plain, settings)


def shared_rows_only(model: nn.Module, arrays: dict[str, Tensor], received: dict[str, Tensor],
                     settings: RunSettings) -> dict[str, Tensor]:
    """Static mode after the split: send only the shared rows of the analysed layers."""
    masks = _masks(received)
    if settings.setting("fedfac.mode", str) != "static" or not masks:
        return arrays
    layer_of_key = _element_layers(model, settings)
    return {k: (v[masks[layer]] if (layer := _layer_of(k, masks, layer_of_key)) else v)
            for k, v in arrays.items()}


def element_state_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    """Partly personal tensors: the client always keeps them (their personal rows)."""
    return list(_element_layers(model, settings))


def _element_layers(model: nn.Module, settings: RunSettings) -> dict[str, str]:
    return {k: layer for layer in analysed_layers(model, settings.setting("fedfac.layers", str))
            for k in element_keys(model, layer)}


def check(settings: RunSettings) -> None:
    one_of("fedfac.mode", settings.setting("fedfac.mode", str), ["static", "dynamic"])
    split = one_of("fedfac.split", settings.setting("fedfac.split", str, "estimate"),
                   ["estimate", "true", "random"])
    if split == "true" and settings.dataset != "synthetic-fedfac":
        raise ConfigError("fedfac.split: 'true' needs dataset synthetic-fedfac; allowed "
                          "elsewhere: estimate, random")
    in_range("fedfac.kappa", settings.setting("fedfac.kappa"), 0, 1, low_open=True)
    settings.setting("fedfac.tau-quantile")
    in_range("fedfac.server-lr", settings.setting("fedfac.server-lr", float, 1.0), 0,
             low_open=True)
    from strategies.registry import build_model  # the registry imports this module

    with torch.device("meta"):
        analysed_layers(build_model(settings), settings.setting("fedfac.layers", str))


METHOD = Method("fedfac", FedFacStrategy, train_everything, all_keys, validate=check,
                merge_received=merge_shared_rows, shape_uplink=shared_rows_only,
                always_personal=element_state_keys, actions=ACTIONS)
