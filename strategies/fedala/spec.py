"""FedALA's settings and wire spec.

Shared: the whole model, FedAvg's keys and bytes. The client also keeps its whole model
(``select_always_personal``): the next round's adaptive local aggregation mixes it with the
global model it receives. The aggregation weights ``W`` and the ``ala_adapted`` flag never
leave the client.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from common.config import ConfigError, KeyGroup, RunSettings, key
from models.fedala import is_personal_key
from strategies.wire import WireSpec, state_keys


@dataclass(frozen=True)
class FedALASettings(KeyGroup):
    layers: int = key("fedala.layers", low=1)
    data_fraction: float = key("fedala.data-fraction", low=0, high=1, low_open=True)
    lr: float = key("fedala.lr", low=0, low_open=True)
    threshold: float = key("fedala.threshold", low=0)
    max_epochs: int = key("fedala.max-epochs", low=1)


def check(settings: RunSettings[FedALASettings], model: nn.Module) -> None:
    tensors = sum(1 for _ in model.parameters())
    if settings.method_settings.layers > tensors:
        raise ConfigError(f"fedala.layers: {settings.method_settings.layers} is more than the "
                          f"model's {tensors} parameter tensors; allowed: [1, {tensors}]")


class WholeModelShared(WireSpec[FedALASettings]):
    def select_shared(self, model: nn.Module) -> list[str]:
        return [k for k in state_keys(model) if not is_personal_key(k)]

    def select_always_personal(self, model: nn.Module) -> list[str]:
        return list(self.shared_keys)
