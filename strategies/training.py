"""Local training: what a method does with its model on one client's data in one round.

A method's client rule is a function ``LocalTraining -> float`` (the mean training loss). The
loops here are its building blocks; each method's rule is in its own ``client`` module
(``strategies/<method>/client.py``), the plain one (``train_everything``) here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from common.config import MethodSettingsT, RunSettings

ExtraLoss = Callable[[nn.Module], Tensor]


@dataclass
class LocalTraining(Generic[MethodSettingsT]):
    """Everything a local-training rule may use."""

    model: nn.Module
    loader: DataLoader
    settings: RunSettings[MethodSettingsT]
    device: torch.device
    server_round: int


@dataclass
class Arrival(LocalTraining[MethodSettingsT]):
    """Everything a method's ``adapt`` step may use where a model arrives (a train or an
    evaluate message, ``Method.adapt``): ``model`` is the client's model with the received
    arrays merged in, adapted in place; ``loader`` the client's train split;
    ``server_round`` the round the received arrays are of; ``received`` what arrived and
    ``own`` the client's personal state before the merge (empty while it has none: its first
    message, or a client that has never trained)."""

    received: dict[str, Tensor]
    own: dict[str, Tensor]


class SGD:
    """Stochastic gradient descent with momentum and weight decay: the update of
    ``torch.optim.SGD`` (its single-tensor path; no dampening, no Nesterov) written out.

    Why not ``torch.optim.SGD`` itself: constructing any ``torch.optim`` optimizer imports
    ``torch._dynamo`` (and SymPy), about 2 s of CPU, once per process. A deployed SuperNode
    starts a fresh ClientApp process for every message, so every message paid it.
    ``tests/test_units.py`` checks this class against ``torch.optim.SGD`` step for step
    (bitwise)."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0) -> None:
        self.params = list(params)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffers: list[Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, param in enumerate(self.params):
            if param.grad is None:
                continue
            grad = param.grad
            if self.weight_decay != 0:
                grad = grad.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad, alpha=1)
                grad = buf
            param.add_(grad, alpha=-self.lr)


def sgd(params: Iterable[nn.Parameter], settings: RunSettings) -> SGD:
    """A fresh optimizer (no optimizer state survives a round: contracts §6)."""
    return SGD(params, lr=settings.lr, momentum=settings.momentum,
               weight_decay=settings.weight_decay)


def train_epochs(job: LocalTraining, params: Iterable[nn.Parameter], epochs: int,
                 extra_loss: ExtraLoss | None = None) -> float:
    """``epochs`` passes of cross-entropy (+ ``extra_loss``) over ``params`` only.

    Returns the mean batch loss (0.0 when ``epochs`` is 0).
    """
    params = list(params)
    if epochs == 0 or not params:
        return 0.0
    trainable = {id(p) for p in params}
    for p in job.model.parameters():
        p.requires_grad_(id(p) in trainable)
    optimizer = sgd(params, job.settings)
    criterion = nn.CrossEntropyLoss()
    job.model.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for x, y in job.loader:
            x, y = x.to(job.device, non_blocking=True), y.to(job.device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            loss = criterion(job.model(x), y)
            if extra_loss is not None:
                loss = loss + extra_loss(job.model)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
    for p in job.model.parameters():
        p.requires_grad_(True)
    return total / max(batches, 1)


def train_everything(job: LocalTraining) -> float:
    """FedAvg, Local, FedPer, FedBN, FedFac: every parameter for ``local-epochs`` epochs."""
    return train_epochs(job, job.model.parameters(), job.settings.local_epochs)


class Evaluation(NamedTuple):
    """A model scored on a client's test split."""

    loss: float  # mean cross-entropy
    accuracy: float  # share of the examples classified right
    task_accuracy: float  # balanced accuracy: mean over the classes present (``accuracy_scores``)


def accuracy_scores(predictions: Tensor, labels: Tensor) -> tuple[float, float]:
    """(accuracy, task accuracy) of ``predictions`` (predicted class per example) against
    ``labels``: the share of examples predicted right, and the mean over the classes present
    in ``labels`` of the share of that class's examples predicted right (balanced accuracy;
    pFedC's mean accuracy over tasks, a task being a class). Every client-side evaluation
    computes both here, from the predictions its accuracy is of. (0.0, 0.0) for no example."""
    predictions, labels = predictions.reshape(-1).cpu(), labels.reshape(-1).cpu()
    if predictions.shape != labels.shape:
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    if len(labels) == 0:
        return 0.0, 0.0
    correct = predictions == labels
    _, class_index = labels.unique(return_inverse=True)
    right_per_class = torch.bincount(class_index, weights=correct.double())
    per_class = right_per_class / torch.bincount(class_index).double()
    return int(correct.sum()) / len(labels), float(per_class.mean())


@torch.no_grad()
def evaluate_model(model: nn.Module, loader: DataLoader, device: torch.device) -> Evaluation:
    """``model`` scored on ``loader``: mean loss, accuracy and task accuracy of its argmax
    predictions (``accuracy_scores``)."""
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss, predictions, labels = 0.0, [], []
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss += criterion(logits, y).item()
        predictions.append(logits.argmax(1).cpu())
        labels.append(y.cpu())
    if not labels:
        return Evaluation(0.0, 0.0, 0.0)
    labels_all = torch.cat(labels)
    accuracy, task_accuracy = accuracy_scores(torch.cat(predictions), labels_all)
    return Evaluation(loss / len(labels_all), accuracy, task_accuracy)


