"""The baselines on the common machinery: FedAvg, FedProx, Local, FedPer, FedRep, FedBN and
FedAvg-FT.

They differ only in which state-dict keys travel (their wire spec) and in their local training
rule; the server side of all of them is the default ``MethodRule`` (example-weighted
mean of what is sent). Each is a few lines, so they live together in this one file.

FedAvg-FT is FedAvg whose clients, before each personalized evaluation, fine-tune a copy of the
received model on their own train split for ``local-epochs`` (every parameter): the simplest
strong personalized baseline. What it trains and sends is FedAvg's exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from common.config import KeyGroup, RunSettings, key, leaves_shared_epochs
from strategies.method import Method
from strategies.training import LocalTraining, train_epochs, train_everything
from strategies.wire import WireSpec, state_keys


# ---------------------------------------------------------------------- wire specs
def no_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    return []


def body_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    """FedPer/FedRep: the classifier ``head`` stays on the client."""
    return [k for k in state_keys(model) if not k.startswith("head.")]


def non_batchnorm_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    """FedBN (Li et al. 2021): BatchNorm affine parameters and running statistics stay
    local."""
    bn = tuple(f"{name}." for name, m in model.named_modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return [k for k in state_keys(model) if not k.startswith(bn)]


class NothingShared(WireSpec):
    """Local: nothing travels (zero bytes)."""

    def select_shared(self, model: nn.Module) -> list[str]:
        return no_keys(model, self.settings)


class BodyShared(WireSpec):
    def select_shared(self, model: nn.Module) -> list[str]:
        return body_keys(model, self.settings)


class NonBatchNormShared(WireSpec):
    def select_shared(self, model: nn.Module) -> list[str]:
        return non_batchnorm_keys(model, self.settings)


# ---------------------------------------------------------------------- settings
@dataclass(frozen=True)
class FedProxSettings(KeyGroup):
    mu: float = key("fedprox.mu", low=0)


@dataclass(frozen=True)
class FedRepSettings(KeyGroup):
    head_epochs: int = key("fedrep.head-epochs")


def check_fedrep(settings: RunSettings[FedRepSettings], model: nn.Module) -> None:
    leaves_shared_epochs("fedrep.head-epochs", settings.method_settings.head_epochs,
                         settings.local_epochs)


# ---------------------------------------------------------------------- client rules
def train_fedprox(job: LocalTraining[FedProxSettings]) -> float:
    """FedProx (Li et al. 2020): loss + mu/2 ||w - w_global||^2 over the received weights."""
    mu = job.settings.method_settings.mu
    anchor = [p.detach().clone() for p in job.model.parameters()]

    def proximal(model: torch.nn.Module) -> torch.Tensor:
        return mu / 2 * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor,
                                                                   strict=True))

    return train_epochs(job, job.model.parameters(), job.settings.local_epochs, proximal)


def train_fedrep(job: LocalTraining[FedRepSettings]) -> float:
    """FedRep (Collins et al. 2021): ``fedrep.head-epochs`` on the head, then the remaining
    ``local-epochs`` on the body."""
    head_epochs = job.settings.method_settings.head_epochs
    head = list(job.model.head.parameters())
    body = list(job.model.body.parameters())
    head_loss = train_epochs(job, head, head_epochs)
    body_epochs = job.settings.local_epochs - head_epochs
    return train_epochs(job, body, body_epochs) if body_epochs > 0 else head_loss


FEDAVG = Method("fedavg", personalized=False)
FEDPROX = Method("fedprox", local_train=train_fedprox, settings=FedProxSettings,
                 personalized=False)
LOCAL = Method("local", wire=NothingShared, dp_refused={
    mode: "it sends nothing, so there is nothing to protect" for mode in ("central", "local")})
FEDPER = Method("fedper", wire=BodyShared)
FEDREP = Method("fedrep", wire=BodyShared, local_train=train_fedrep, settings=FedRepSettings,
                check=check_fedrep)
FEDBN = Method("fedbn", wire=NonBatchNormShared)
FEDAVG_FT = Method("fedavg-ft", fine_tune=train_everything, personalized=False)
