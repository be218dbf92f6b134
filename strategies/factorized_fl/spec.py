"""Factorized-FL's settings and wire spec.

What is shared (``factorized-fl.variant``); in every variant the uplink adds the matching
vector ``v`` of the last layer before the classifier, and BatchNorm running statistics and the
classifier ``head`` stay on the client (the head is personal, as in the paper's permuted-label
and multi-domain settings):
- ``"u"`` (default; what the authors' code shares): downlink and uplink carry every factorized
  layer's ``u`` and also the body's biases and BatchNorm affine parameters, which the paper
  does not list as shared. Every other ``v`` and every ``mu`` stay on the client.
- ``"u-paper"`` (the paper's set): only every factorized layer's ``u`` goes down and up; the
  biases and BatchNorm affine parameters stay personal too.
- ``"uvm"`` (the paper's Factorized-FL beta): ``u``, ``v`` and ``mu`` of every layer as well
  (plus biases and BatchNorm affine parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from common.config import KeyGroup, RunSettings, key
from common.protocol import ArraySpec
from fldata import dataset_shape
from models.factorized_fl import MU_INITS, factorized_layers, matching_key
from strategies.wire import Masks, WireSpec, is_running_stat, state_keys, tensor_spec


@dataclass(frozen=True)
class FactorizedFLSettings(KeyGroup):
    tau: float = key("factorized-fl.tau", low=-1, high=1)
    epsilon: float = key("factorized-fl.epsilon", low=0)
    l1: float = key("factorized-fl.l1", low=0)
    variant: str = key("factorized-fl.variant", choices=("u", "u-paper", "uvm"))
    mu_init: str = key("factorized-fl.mu-init", choices=MU_INITS)
    min_aggregated: int = key("factorized-fl.min-aggregated", low=1)


class FactorsShared(WireSpec[FactorizedFLSettings]):
    def __init__(self, model: nn.Module, settings: RunSettings[FactorizedFLSettings]) -> None:
        super().__init__(model, settings)
        self.match_key = matching_key(model, dataset_shape(settings)[0])
        self.uplink: ArraySpec = {**self.shared_spec,
                                  **tensor_spec(model.state_dict(), [self.match_key])}

    def select_shared(self, model: nn.Module) -> list[str]:
        """The downlink: see the module docstring."""
        variant = self.settings.method_settings.variant
        layers = factorized_layers(model)
        if variant == "u-paper":
            return [f"{layer}.u" for layer in layers]
        private = ("head.", ) if variant == "uvm" else (
            "head.", *(f"{layer}.{factor}" for layer in layers for factor in ("v", "mu")))
        return [k for k in state_keys(model)
                if not k.startswith(private) and not is_running_stat(k)]

    def uplink_spec(self, info: Mapping[str, Any], masks: Masks | None) -> ArraySpec:
        """The shared keys plus the matching vector."""
        return self.uplink
