"""The baselines on the common machinery: FedAvg, FedProx, Local, FedPer, FedRep, FedBN.

They differ only in which state-dict keys are shared and in their local training rule; the
server side of all six is the plain ``PersonalizedStrategy`` (weighted mean of what is sent).
"""

from __future__ import annotations

from torch import nn

from client_app.training.baselines import train_everything, train_fedprox, train_fedrep
from common.config import ConfigError, RunSettings, in_range
from strategies.base import PersonalizedStrategy
from strategies.method import Method


def state_keys(model: nn.Module) -> list[str]:
    """Every state-dict entry except BatchNorm's batch counters (an int, meaningless to
    average)."""
    return [k for k in model.state_dict() if not k.endswith("num_batches_tracked")]


def all_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    return state_keys(model)


def no_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    return []


def body_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    """FedPer/FedRep: the classifier ``head`` stays on the client."""
    return [k for k in state_keys(model) if not k.startswith("head.")]


def non_batchnorm_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    """FedBN (Li et al. 2021): BatchNorm affine parameters and running statistics stay local."""
    bn = tuple(f"{name}." for name, m in model.named_modules()
               if isinstance(m, nn.modules.batchnorm._BatchNorm))
    return [k for k in state_keys(model) if not k.startswith(bn)]


def _check_fedprox(settings: RunSettings) -> None:
    in_range("fedprox.mu", settings.setting("fedprox.mu"), 0)


def _check_fedrep(settings: RunSettings) -> None:
    head_epochs = settings.setting("fedrep.head-epochs", int)
    if not 0 <= head_epochs <= settings.local_epochs:
        raise ConfigError(f"fedrep.head-epochs: {head_epochs} is out of range; allowed: "
                          f"[0, local-epochs={settings.local_epochs}]")


METHODS = [
    Method("fedavg", PersonalizedStrategy, train_everything, all_keys),
    Method("fedprox", PersonalizedStrategy, train_fedprox, all_keys, validate=_check_fedprox),
    Method("local", PersonalizedStrategy, train_everything, no_keys),
    Method("fedper", PersonalizedStrategy, train_everything, body_keys),
    Method("fedrep", PersonalizedStrategy, train_fedrep, body_keys, validate=_check_fedrep),
    Method("fedbn", PersonalizedStrategy, train_everything, non_batchnorm_keys),
]
