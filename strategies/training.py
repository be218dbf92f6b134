"""Local training: what a method does with its model on one client's data in one round.

A method's client rule is a function ``LocalTraining -> float`` (the mean training loss). The
loops here are its building blocks; each method's rule is in its own ``client`` module
(``strategies/<method>/client.py``), the plain one (``train_everything``) here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic

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


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on ``loader``."""
    model.eval()
    criterion = nn.CrossEntropyLoss(reduction="sum")
    loss, correct, count = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss += criterion(logits, y).item()
        correct += (logits.argmax(1) == y).sum().item()
        count += len(y)
    return loss / max(count, 1), correct / max(count, 1)
