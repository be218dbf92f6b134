"""Ditto's client side: the global model trained as FedAvg, then the personal model with a
proximal term towards the global model as received.

Per round: ``local-epochs - ditto.personal-epochs`` epochs of plain local training on the
global copy ``w`` (what is sent: FedAvg's update), then ``ditto.personal-epochs`` epochs on
the personal model ``v`` with ``ditto.lambda / 2 * ||v - w_t||^2`` added to its loss, ``w_t``
the global model the client received this round (the paper's Algorithm 1), each phase with a
fresh optimizer. The train loss reported is the global model's (FedAvg's).

``adapt_ditto``: a client that has no personal model yet (its first message) starts it from
the global model it receives, so that a client drawn for evaluation before it ever trained
is scored with the global model, not with the seeded initialisation.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from models.ditto import PERSONAL, Ditto
from strategies.ditto.spec import DittoSettings
from strategies.training import Arrival, LocalTraining, train_epochs


def train_ditto(job: LocalTraining[DittoSettings]) -> float:
    ditto: Ditto = job.model  # type: ignore[assignment]
    settings = job.settings.method_settings
    anchor = [p.detach().clone() for p in ditto.shared.parameters()]  # w_t, as received
    global_epochs = job.settings.local_epochs - settings.personal_epochs
    loss = train_epochs(dataclasses.replace(job, model=ditto.shared), ditto.shared.parameters(),
                        global_epochs)

    def proximal(personal: nn.Module) -> torch.Tensor:
        return settings.lam / 2 * sum(((v - w) ** 2).sum() for v, w in
                                      zip(personal.parameters(), anchor, strict=True))

    personal_loss = train_epochs(dataclasses.replace(job, model=ditto.personal),
                                 ditto.personal.parameters(), settings.personal_epochs,
                                 proximal)
    return loss if global_epochs > 0 else personal_loss


def adapt_ditto(job: Arrival[DittoSettings]) -> None:
    if not any(k.startswith(f"{PERSONAL}.") for k in job.own):
        ditto: Ditto = job.model  # type: ignore[assignment]
        ditto.personal.load_state_dict(ditto.shared.state_dict())
