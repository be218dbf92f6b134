"""Factorized-FL's settings and wire spec.

What is shared (``factorized-fl.variant``):
- ``"u"`` (the paper's Factorized-FL): downlink and uplink carry every factorized layer's ``u``,
  the body's biases and BatchNorm affine parameters; the uplink adds the matching vector
  ``v`` of the last layer before the classifier. Every other ``v``, every ``mu``, BatchNorm
  running statistics and the classifier ``head`` stay on the client (the head is personal,
  as in the paper's permuted-label and multi-domain settings).
- ``"uvm"`` (the paper's Factorized-FL beta): ``u``, ``v`` and ``mu`` of every layer as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from common.config import KeyGroup, RunSettings, key
from common.protocol import ArraySpec
from models.factorized_fl import factorized_layers, matching_key
from strategies.wire import Masks, WireSpec, state_keys, tensor_spec


@dataclass(frozen=True)
class FactorizedFLSettings(KeyGroup):
    tau: float = key("factorized-fl.tau", low=-1, high=1)
    epsilon: float = key("factorized-fl.epsilon", low=0)
    l1: float = key("factorized-fl.l1", low=0)
    variant: str = key("factorized-fl.variant", choices=("u", "uvm"))


class FactorsShared(WireSpec):
    def __init__(self, model: nn.Module, settings: RunSettings) -> None:
        super().__init__(model, settings)
        self.match_key = matching_key(model)
        self.uplink: ArraySpec = {**self.shared_spec,
                                  **tensor_spec(model.state_dict(), [self.match_key])}

    def select_shared(self, model: nn.Module) -> list[str]:
        """The downlink: see the module docstring."""
        private = ("head.", ) if self.settings.method_settings.variant == "uvm" else (
            "head.", *(f"{layer}.{factor}" for layer in factorized_layers(model)
                       for factor in ("v", "mu")))
        return [k for k in state_keys(model)
                if not k.startswith(private) and "running_" not in k]

    def uplink_spec(self, info: Mapping[str, Any], masks: Masks | None) -> ArraySpec:
        """The shared keys plus the matching vector."""
        return self.uplink
