"""FedDecomp (Wu et al., ACM MM 2024): average ``sigma``, keep ``tau = B A`` on the client.

Shared: every state-dict entry except the factors ``lora_A``/``lora_B`` and BatchNorm's batch
counters, i.e. exactly FedAvg's keys and bytes (``sigma`` keeps the original weight names):
``sigma`` of every Linear/Conv2d, their biases, and BatchNorm affine parameters and running
statistics (as in the paper's code). The server is FedAvg over those: example-weighted mean,
the same aggregate sent to every client, which adds its own ``tau``.
"""

from __future__ import annotations

from torch import nn

from client_app.training.feddecomp import train_feddecomp
from common.config import ConfigError, RunSettings, in_range
from models.feddecomp import decompose, is_personal_key
from strategies.base import PersonalizedStrategy
from strategies.baselines import state_keys
from strategies.method import Method


def sigma_keys(model: nn.Module, settings: RunSettings) -> list[str]:
    return [k for k in state_keys(model) if not is_personal_key(k)]


def check(settings: RunSettings) -> None:
    in_range("feddecomp.rank-conv", settings.setting("feddecomp.rank-conv"), 0, 1, low_open=True)
    in_range("feddecomp.rank-linear", settings.setting("feddecomp.rank-linear"), 0, 1,
             low_open=True)
    lora_epochs = settings.setting("feddecomp.lora-epochs", int)
    if not 0 <= lora_epochs <= settings.local_epochs:
        raise ConfigError(f"feddecomp.lora-epochs: {lora_epochs} is out of range; allowed: "
                          f"[0, local-epochs={settings.local_epochs}]")


METHOD = Method("feddecomp", PersonalizedStrategy, train_feddecomp, sigma_keys,
                transform=decompose, validate=check)
