"""pFedC's server rule.

Per round: ``phi <- sum_i (D_i / D) phi_i`` over the replies (eq. 6); for each task ``t``,
``omega^t <- sum_n w_n^t omega_n^t / sum_n w_n^t`` over every client ``n`` known to hold ``t``
(latest branches, so clients not sampled this round still count), with ``w_n^t`` the task
weights of the wire spec. ``pfedc.weighting = "uniform"`` (default): ``w_n^t = pi_n^t`` in
{0, 1}, the masked mean of eq. 7 (``m_{i,n}^t = pi_i^t pi_n^t``): every holder counts once.
``"counts"`` (an option, not the paper's rule): ``w_n^t`` = the client's examples of ``t``'s
classes. Client ``i`` receives ``phi`` and ``omega^t`` for the tasks it holds (per-node
downlink); its other branches stay its own, never touched by the server.
``pfedc.branches = "personal"`` (an ablation, not the paper's rule): no branch is averaged;
client ``i`` receives its own latest branches back, everything else unchanged, so that a run
measures what eq. 7's averaging is worth.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np
from flwr.app import Array, ArrayRecord

from common.protocol import ClientReply
from models.pfedc import branch_of_key
from strategies.engine import MethodRule, RuleContext
from strategies.pfedc.spec import HeldBranches, PFedCSettings


def masked_branch_average(branches: dict[str, dict[str, np.ndarray]],
                          task_weights: dict[str, list[float]],
                          keys_of_task: dict[int, list[str]]) -> dict[str, np.ndarray]:
    """Per task, the ``task_weights``-weighted mean of the branches of the clients that hold
    it (weight > 0): eq. 7 when the weights are the 0/1 presence vectors (``uniform``).
    Tasks nobody holds are absent from the result."""
    averaged: dict[str, np.ndarray] = {}
    for task, keys in keys_of_task.items():
        holders = [(cid, w[task]) for cid, w in task_weights.items() if w[task] > 0]
        if not holders:
            continue
        total = sum(w for _, w in holders)
        for name in keys:
            dtype = branches[holders[0][0]][name].dtype
            averaged[name] = sum(branches[cid][name].astype(np.float64) * (w / total)
                                 for cid, w in holders).astype(dtype)
    return averaged


class PFedCState(TypedDict):
    """What the checkpoint keeps of pFedC's server, per client id: its task weights and its
    latest branches."""

    task_weights: dict[str, list[float]]
    branches: dict[str, dict[str, np.ndarray]]


class PFedCRule(MethodRule[PFedCSettings]):
    wire: HeldBranches

    def __init__(self, run: RuleContext[PFedCSettings]) -> None:
        super().__init__(run)
        self.keys_of_task = self.wire.keys_of_task
        self.task_weights: dict[str, list[float]] = {}
        self.branches: dict[str, dict[str, np.ndarray]] = {}

    def state(self) -> PFedCState:
        return {"task_weights": self.task_weights, "branches": self.branches}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.task_weights = dict(state["task_weights"])
        self.branches = dict(state["branches"])

    def forget(self, client_id: str) -> None:
        self.task_weights.pop(client_id, None)
        self.branches.pop(client_id, None)

    def merge_updates(self, server_round: int, replies: list[ClientReply],
                      arrays: ArrayRecord) -> ArrayRecord:
        phi_keys = self.wire.phi_keys
        phi = self.run.aggregate(replies, phi_keys, arrays)
        for reply in replies:
            self.task_weights[reply.client_id] = self.wire.task_weights(reply.info)
            self.branches[reply.client_id] = {k: reply.arrays[k].numpy() for k in reply.arrays
                                              if branch_of_key(k) is not None}
        averaged = (masked_branch_average(self.branches, self.task_weights, self.keys_of_task)
                    if self.settings.method_settings.branches == "averaged" else {})
        merged = {k: phi[k] for k in phi_keys}
        for keys in self.keys_of_task.values():
            for name in keys:  # a task nobody holds keeps its previous value
                merged[name] = Array(averaged[name]) if name in averaged else arrays[name]
        return ArrayRecord(merged)

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        weights = self.task_weights.get(client_id) if client_id is not None else None
        if weights is None:
            return arrays
        own = (self.branches[client_id]
               if self.settings.method_settings.branches == "personal" else {})
        return ArrayRecord({k: Array(own[k]) if k in own else arrays[k]
                            for k in self.wire.held_keys(list(arrays), weights)})

    def results_tables(self) -> dict[str, Any]:
        return {"pfedc": {"task_weights": self.task_weights}}
