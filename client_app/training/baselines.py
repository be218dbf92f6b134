"""Local training rules of the baselines."""

from __future__ import annotations

import torch

from client_app.training import LocalTraining, train_epochs


def train_everything(job: LocalTraining) -> float:
    """FedAvg, Local, FedPer, FedBN: every parameter for ``local-epochs`` epochs."""
    return train_epochs(job, job.model.parameters(), job.settings.local_epochs)


def train_fedprox(job: LocalTraining) -> float:
    """FedProx (Li et al. 2020): loss + mu/2 ||w - w_global||^2 over the received weights."""
    mu = job.settings.setting("fedprox.mu")
    anchor = [p.detach().clone() for p in job.model.parameters()]

    def proximal(model: torch.nn.Module) -> torch.Tensor:
        return mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor,
                                                                   strict=True))

    return train_epochs(job, job.model.parameters(), job.settings.local_epochs, proximal)


def train_fedrep(job: LocalTraining) -> float:
    """FedRep (Collins et al. 2021): ``fedrep.head-epochs`` on the head, then the remaining
    ``local-epochs`` on the body."""
    head_epochs = job.settings.setting("fedrep.head-epochs", int)
    head = list(job.model.head.parameters())
    body = list(job.model.body.parameters())
    head_loss = train_epochs(job, head, head_epochs)
    body_epochs = job.settings.local_epochs - head_epochs
    return train_epochs(job, body, body_epochs) if body_epochs > 0 else head_loss
