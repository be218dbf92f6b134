"""pFedC: shared representation averaged by all, each class branch only among its holders.

Uplink of client ``i``: ``phi`` (every ``body.*`` key), the branches of the tasks it holds,
and, in its ``client`` ConfigRecord, ``pfedc.task-weights``: per task, its number of training
examples of that task's classes (``pfedc.weighting = "counts"``) or just 1/0 for held/not held
(``"uniform"``, which reveals only the label presence vector ``pi_i``). This vector is sensitive
(it is the client's label distribution or presence); the server keeps it per client id and
writes it to ``results.json`` under ``server_state.pfedc.task_weights`` so users can see what
was disclosed. Branches of tasks a client does not hold never leave it.

Server, per round: ``phi <- sum_i (D_i / D) phi_i`` over the replies (eq. 6); for each task
``t``, ``omega^t <- sum_n w_n^t omega_n^t / sum_n w_n^t`` over every client ``n`` known to hold
``t`` (latest branches, so clients not sampled this round still count), with ``w_n^t`` the
task weights above: the masked mean of eq. 7 (``m_{i,n}^t = pi_i^t pi_n^t``), weighted by class
counts or uniform. Client ``i`` receives ``phi`` and ``omega^t`` for the tasks it holds (per-node
downlink); its other branches stay its own. A client not seen yet receives every branch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from torch import nn

from client_app.training.pfedc import train_pfedc
from common.config import RunSettings, in_range, one_of
from fldata import ClientData, dataset_shape
from models.pfedc import branch_of_key, task_groups, with_branches
from strategies.base import NUM_EXAMPLES, ArraySpec, ClientReply, PersonalizedStrategy, ReplyError
from strategies.baselines import state_keys
from strategies.method import Method

TASK_WEIGHTS = "pfedc.task-weights"


def masked_branch_average(branches: dict[str, dict[str, np.ndarray]],
                          task_weights: dict[str, list[float]],
                          keys_of_task: dict[int, list[str]]) -> dict[str, np.ndarray]:
    """Eq. 7: per task, the ``task_weights``-weighted mean of the branches of the clients
    that hold it (weight > 0). Tasks nobody holds are absent from the result."""
    averaged: dict[str, np.ndarray] = {}
    for task, keys in keys_of_task.items():
        holders = [(cid, w[task]) for cid, w in task_weights.items() if w[task] > 0]
        if not holders:
            continue
        total = sum(w for _, w in holders)
        for key in keys:
            dtype = branches[holders[0][0]][key].dtype
            averaged[key] = sum(branches[cid][key].astype(np.float64) * (w / total)
                                for cid, w in holders).astype(dtype)
    return averaged


class PFedCStrategy(PersonalizedStrategy):
    checkpointed = (*PersonalizedStrategy.checkpointed, "task_weights", "branches")

    def __init__(self, settings: RunSettings, initial_arrays: ArrayRecord) -> None:
        super().__init__(settings, initial_arrays)
        self.phi_keys = [k for k in initial_arrays if branch_of_key(k) is None]
        self.keys_of_task: dict[int, list[str]] = {}
        for key in initial_arrays:
            task = branch_of_key(key)
            if task is not None:
                self.keys_of_task.setdefault(task, []).append(key)
        self.task_weights: dict[str, list[float]] = {}
        self.branches: dict[str, dict[str, np.ndarray]] = {}

    def _weights_of(self, info: ConfigRecord) -> list[float]:
        weights = info.get(TASK_WEIGHTS)
        if (not isinstance(weights, list) or len(weights) != len(self.keys_of_task)
                or any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0):
            raise ReplyError(f"{TASK_WEIGHTS} must list {len(self.keys_of_task)} "
                             "non-negative task weights, not all zero")
        return [float(w) for w in weights]

    def expected_uplink(self, client_id: str, info: ConfigRecord) -> ArraySpec:
        weights = self._weights_of(info)
        held = [k for t, keys in self.keys_of_task.items() if weights[t] > 0 for k in keys]
        return {k: self.shared_spec[k] for k in [*self.phi_keys, *held]}

    def aggregate_shared(self, server_round: int, replies: list[ClientReply],
                         arrays: ArrayRecord) -> ArrayRecord:
        phi = aggregate_arrayrecords([RecordDict({"arrays": ArrayRecord(
            {k: r.arrays[k] for k in self.phi_keys}), "metrics": r.metrics}) for r in replies],
            NUM_EXAMPLES)
        for reply in replies:
            self.task_weights[reply.client_id] = self._weights_of(reply.info)
            self.branches[reply.client_id] = {k: reply.arrays[k].numpy() for k in reply.arrays
                                              if branch_of_key(k) is not None}
        averaged = masked_branch_average(self.branches, self.task_weights, self.keys_of_task)
        merged = {k: phi[k] for k in self.phi_keys}
        for keys in self.keys_of_task.values():
            for key in keys:  # a task nobody holds keeps its previous value
                merged[key] = Array(averaged[key]) if key in averaged else arrays[key]
        return ArrayRecord(merged)

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        weights = self.task_weights.get(client_id) if client_id is not None else None
        if weights is None:
            return arrays
        return ArrayRecord({k: arrays[k] for k in arrays
                            if (t := branch_of_key(k)) is None or weights[t] > 0})

    def state_tables(self) -> dict[str, Any]:
        return {"pfedc": {"task_weights": self.task_weights}}


def branch_holding_keys(model: nn.Module, keys: list[str], data: ClientData,
                        settings: RunSettings) -> list[str]:
    weights = task_weights(data, settings)
    return [k for k in keys if (t := branch_of_key(k)) is None or weights[t] > 0]


def task_weights(data: ClientData, settings: RunSettings) -> list[float]:
    counts = np.bincount(data.y_train, minlength=data.num_classes)
    groups = task_groups(data.num_classes, settings.setting("pfedc.tasks", int))
    per_task = [float(counts[g].sum()) for g in groups]
    if settings.setting("pfedc.weighting", str, "counts") == "uniform":
        return [float(c > 0) for c in per_task]
    return per_task


def report_task_weights(data: ClientData, settings: RunSettings) -> dict[str, Any]:
    return {TASK_WEIGHTS: task_weights(data, settings)}


def shared_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    return state_keys(model)


def check(settings: RunSettings) -> None:
    _, num_classes = dataset_shape(settings)
    tasks = settings.setting("pfedc.tasks", int)
    in_range("pfedc.tasks", tasks, 0, num_classes)
    settings.setting("pfedc.mgda", bool)
    one_of("pfedc.weighting", settings.setting("pfedc.weighting", str, "counts"),
           ["counts", "uniform"])


METHOD = Method("pfedc", PFedCStrategy, train_pfedc, shared_keys, transform=with_branches,
                validate=check, uplink_keys=branch_holding_keys, client_info=report_task_weights)
