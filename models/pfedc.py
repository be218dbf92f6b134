"""pFedC's model transform: the classifier becomes one branch per (virtual) task.

"Disentangled knowledge transfer: a new perspective for personalized federated learning".
The backbone's ``body`` is the shared representation ``phi``; its ``head`` is replaced by
``T`` branches ``omega^1..omega^T`` (state-dict keys ``head.branches.<t>.weight/bias``).

Tasks: ``pfedc.tasks = 0`` gives ``T = C`` tasks, task ``c`` = "is it class c"; ``0 < T < C``
cuts the classes into ``T`` consecutive groups (``numpy.array_split`` order). With ``T > 1``
branch ``t`` is a Linear with one logit per class of its group plus one "other" logit, trained
with softmax cross-entropy against "the class if it is in the group, else other" (for
``T = C`` that is the binary "class c or not"). With ``T = 1`` there is no "other" logit: the
single branch is an ordinary C-way classifier, so pFedC with one task is FedAvg.

Prediction: each branch's log-softmax score of its own classes, put side by side into C
class scores; the argmax over those is the C-way decision.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F


def task_groups(num_classes: int, tasks: int) -> list[list[int]]:
    """Classes of each task: one per class when ``tasks`` is 0, else consecutive groups."""
    if tasks == 0:
        return [[c] for c in range(num_classes)]
    return [part.tolist() for part in np.array_split(np.arange(num_classes), tasks)]


class BranchHead(nn.Module):
    """``T`` task branches over the shared features.

    Each branch is its own ``nn.Linear`` (so its state-dict keys can be averaged per task), but
    all of them run as one matmul: their logits are laid out in a ``(T, K)`` grid (``K`` = the
    largest branch; missing slots are ``-inf``), so the per-task losses and the prediction cost
    a few tensor ops whatever ``T`` is."""

    def __init__(self, feature_dim: int, groups: list[list[int]]) -> None:
        super().__init__()
        self.groups = groups
        self.num_classes = sum(len(g) for g in groups)
        self.with_other = len(groups) > 1
        sizes = [len(g) + int(self.with_other) for g in groups]
        self.branches = nn.ModuleList(nn.Linear(feature_dim, size) for size in sizes)
        width, total = max(sizes), sum(sizes)
        # grid slot (t, k) -> column of the concatenated logits; ``total`` is the -inf column
        grid = torch.full((len(groups), width), total, dtype=torch.long)
        offset = 0
        for t, size in enumerate(sizes):
            grid[t, :size] = torch.arange(offset, offset + size)
            offset += size
        task_of_class = torch.empty(self.num_classes, dtype=torch.long)
        slot_of_class = torch.empty(self.num_classes, dtype=torch.long)
        # target_of_class[c, t]: class c's slot in task t, or t's "other" slot
        target_of_class = torch.tensor([len(g) for g in groups]).repeat(self.num_classes, 1)
        for t, group in enumerate(groups):
            for slot, c in enumerate(group):
                task_of_class[c], slot_of_class[c] = t, slot
                target_of_class[c, t] = slot
        for name, value in (("grid", grid), ("task_of_class", task_of_class),
                            ("slot_of_class", slot_of_class),
                            ("target_of_class", target_of_class)):
            self.register_buffer(name, value, persistent=False)

    def task_log_probs(self, z: Tensor) -> Tensor:
        """``(N, T, K)``: each branch's log-softmax, ``-inf`` in slots it does not have."""
        weight = torch.cat([b.weight for b in self.branches])
        bias = torch.cat([b.bias for b in self.branches])
        logits = F.linear(z, weight, bias)
        padded = torch.cat([logits, logits.new_full((z.shape[0], 1), float("-inf"))], dim=1)
        return F.log_softmax(padded[:, self.grid], dim=2)

    def task_targets(self, y: Tensor) -> Tensor:
        """``(N, T)``: per task, the class's slot in the group, or the "other" slot."""
        return self.target_of_class[y]

    def task_losses(self, z: Tensor, y: Tensor) -> Tensor:
        """``(T,)``: each task's mean cross-entropy over the batch."""
        log_probs = self.task_log_probs(z)
        picked = log_probs.gather(2, self.task_targets(y).unsqueeze(2)).squeeze(2)
        return -picked.mean(dim=0)

    def forward(self, z: Tensor) -> Tensor:
        return self.task_log_probs(z)[:, self.task_of_class, self.slot_of_class]


def with_branches(model: nn.Module, tasks: int) -> nn.Module:
    """Replace ``model.head`` by a ``BranchHead`` over ``tasks`` tasks (``pfedc.tasks``).

    Each branch starts from the original head's rows for its classes (the "other" logit keeps
    its own fresh initialisation), so with one task the model is exactly the backbone."""
    old = model.head
    groups = task_groups(old.out_features, tasks)
    head = BranchHead(model.feature_dim, groups)
    with torch.no_grad():
        for group, branch in zip(groups, head.branches, strict=True):
            branch.weight[:len(group)] = old.weight[group]
            if old.bias is not None:  # a user's classifier may have none
                branch.bias[:len(group)] = old.bias[group]
    model.head = head
    return model


def branch_of_key(key: str) -> int | None:
    """Task index of a ``head.branches.<t>.*`` key; None for the representation."""
    if not key.startswith("head.branches."):
        return None
    return int(key.split(".")[2])
