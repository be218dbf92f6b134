"""Ditto's settings and wire spec.

Shared: the global model's entries (``shared.*``, FedAvg's keys under that prefix: the same
bytes as FedAvg's). The personal model (``personal.*``) never leaves the client; it lives in
its personal state like any key that is not sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from common.config import ConfigError, KeyGroup, RunSettings, key
from models.ditto import is_personal_key
from strategies.wire import WireSpec, state_keys


@dataclass(frozen=True)
class DittoSettings(KeyGroup):
    lam: float = key("ditto.lambda", low=0)
    personal_epochs: int = key("ditto.personal-epochs", low=1)


def check(settings: RunSettings[DittoSettings], model: nn.Module) -> None:
    """Both models train every round: the personal model's epochs leave at least one of
    ``local-epochs`` to the global model."""
    epochs, local = settings.method_settings.personal_epochs, settings.local_epochs
    if epochs >= local:
        raise ConfigError(f"ditto.personal-epochs: {epochs} leaves no epoch of local-epochs="
                          f"{local} to the global model; allowed: [1, local-epochs - 1], so "
                          "local-epochs of at least 2")


class GlobalShared(WireSpec[DittoSettings]):
    def select_shared(self, model: nn.Module) -> list[str]:
        return [k for k in state_keys(model) if not is_personal_key(k)]
