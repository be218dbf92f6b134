"""pFedC's settings and wire spec.

Uplink of client ``i``: ``phi`` (every ``body.*`` key), the branches of the tasks it holds,
and, in its ``client`` record, ``pfedc.task-weights``: per task 1/0 for held/not held
(``pfedc.weighting = "uniform"``, the default and eq. 7's rule, which reveals only the label
presence vector ``pi_i``) or its number of training examples of that task's classes
(``"counts"``, which reveals its label histogram). This vector is sensitive (it is the
client's label presence or distribution); the server keeps it per client id and
writes it to ``results.json`` under ``server_state.pfedc.task_weights`` so users can see what
was disclosed. Branches of tasks a client does not hold never leave it.

Downlink of a known client: ``phi`` and the branches of the tasks it holds (the same rule);
a client not seen yet receives every branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from common.config import ConfigError, KeyGroup, RunSettings, in_range
from common.config import key as config_key
from common.protocol import ArraySpec
from fldata import ClientData, dataset_shape
from models.pfedc import branch_of_key, task_groups
from strategies.wire import Masks, WireSpec

TASK_WEIGHTS = "pfedc.task-weights"


@dataclass(frozen=True)
class PFedCSettings(KeyGroup):
    tasks: int = config_key("pfedc.tasks", low=0)
    mgda: bool = config_key("pfedc.mgda")
    weighting: str = config_key("pfedc.weighting", choices=("uniform", "counts"))
    branches: str = config_key("pfedc.branches", choices=("averaged", "personal"))


def check(settings: RunSettings[PFedCSettings], model: nn.Module) -> None:
    _, num_classes = dataset_shape(settings)
    in_range("pfedc.tasks", settings.method_settings.tasks, 0, num_classes)
    if settings.dp_mode and settings.method_settings.weighting == "counts":
        raise ConfigError("pfedc.weighting='counts' with dp.mode: each client's class counts "
                          "would leave it without noise; use pfedc.weighting='uniform'")


class HeldBranches(WireSpec[PFedCSettings]):
    def __init__(self, model: nn.Module, settings: RunSettings[PFedCSettings]) -> None:
        super().__init__(model, settings)
        self.phi_keys = [k for k in self.shared_keys if branch_of_key(k) is None]
        self.keys_of_task: dict[int, list[str]] = {}
        for name in self.shared_keys:
            task = branch_of_key(name)
            if task is not None:
                self.keys_of_task.setdefault(task, []).append(name)

    def select_personal(self, model: nn.Module) -> list[str]:
        """A client keeps the branches of the tasks it does not hold: with one task there
        are none (pFedC with one task is FedAvg)."""
        branches = [k for k in self.shared_keys if branch_of_key(k) is not None]
        tasks = {branch_of_key(k) for k in branches}
        return branches if len(tasks) > 1 else []

    def client_info(self, data: ClientData) -> dict[str, Any]:
        counts = np.bincount(data.y_train, minlength=data.num_classes)
        options = self.settings.method_settings
        groups = task_groups(data.num_classes, options.tasks)
        if self.settings.dp_mode == "local":
            # which classes a client holds is its data's: under local DP nothing exact
            # leaves it, so it claims every task (each branch is averaged over every client)
            return {TASK_WEIGHTS: [1.0] * len(groups)}
        per_task = [float(counts[g].sum()) for g in groups]
        if options.weighting == "uniform":
            per_task = [float(c > 0) for c in per_task]
        return {TASK_WEIGHTS: per_task}

    def task_weights(self, info: Mapping[str, Any]) -> list[float]:
        """The ``pfedc.task-weights`` of a ``client`` record, checked."""
        weights = info.get(TASK_WEIGHTS)
        if (not isinstance(weights, list) or len(weights) != len(self.keys_of_task)
                or any(isinstance(w, bool) or not isinstance(w, int | float)
                       or not np.isfinite(w) or w < 0 for w in weights)
                or sum(weights) <= 0):
            raise ValueError(f"{TASK_WEIGHTS} must list {len(self.keys_of_task)} "
                             "non-negative task weights, not all zero")
        return [float(w) for w in weights]

    def held_keys(self, keys: list[str], weights: list[float]) -> list[str]:
        """``keys`` less the branches of tasks with weight 0 (both directions)."""
        return [k for k in keys if (t := branch_of_key(k)) is None or weights[t] > 0]

    def uplink_spec(self, info: Mapping[str, Any], masks: Masks | None) -> ArraySpec:
        held = self.held_keys(self.shared_keys, self.task_weights(info))
        return {k: self.shared_spec[k] for k in held}
