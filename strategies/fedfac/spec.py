"""FedFac's settings and wire spec: shared rows of the analysed layers, and the split.

The hidden elements of every layer in ``fedfac.layers`` (``models/fedfac.py``) are split into
shared and personal ones by the server. Downlink: every shared key, but of the analysed
layers' tensors only the shared rows, plus the split as ``fedfac.mask.<layer>`` (uint8)
arrays; a client puts the shared rows in place and keeps its own personal rows (so it always
keeps the analysed layers' tensors: they are partly personal). Uplink: every shared key whole
(before the split, and every round in dynamic mode: the analysis needs whole layers), or, in
static mode once the split exists, only the shared rows of the analysed layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor, nn

from common.config import ConfigError, KeyGroup, RunSettings, key
from common.protocol import ArraySpec
from fldata import dataset_shape
from models.fedfac import analysed_layers, element_keys
from strategies.wire import Masks, WireSpec, travelling

MASK_PREFIX = "fedfac.mask."
MEMBER_PREFIX = "member."  # new-client Ensemble: member.<i>.<key> = existing client i's tensor


@dataclass(frozen=True)
class FedFacSettings(KeyGroup):
    layers: str = key("fedfac.layers")
    mode: str = key("fedfac.mode", choices=("static", "dynamic"))
    kappa: float = key("fedfac.kappa", low=0, high=1, low_open=True)
    tau_quantile: float = key("fedfac.tau-quantile")
    server_lr: float = key("fedfac.server-lr", low=0, low_open=True)
    new_clients: float = key("fedfac.new-clients", low=0, high=1)
    split: str = key("fedfac.split", choices=("estimate", "true", "random"))
    analysis: str = key("fedfac.analysis", choices=("updates", "weights"))
    warmup_rounds: int = key("fedfac.warmup-rounds", low=0)


def check(settings: RunSettings[FedFacSettings], model: nn.Module) -> None:
    if settings.method_settings.split == "true" and settings.dataset != "synthetic-fedfac":
        raise ConfigError("fedfac.split: 'true' needs dataset synthetic-fedfac; allowed "
                          "elsewhere: estimate, random")
    analysed_layers(model, settings.method_settings.layers, dataset_shape(settings)[0])
    if settings.dp_mode and settings.method_settings.new_clients > 0:
        raise ConfigError("fedfac.new-clients with dp.mode: the new-client ensemble sends "
                          "the existing clients' personal rows to the server; set "
                          "fedfac.new-clients=0")


class SharedRows(WireSpec[FedFacSettings]):
    def __init__(self, model: nn.Module, settings: RunSettings[FedFacSettings]) -> None:
        self.layers = analysed_layers(model, settings.method_settings.layers,
                                      dataset_shape(settings)[0])
        self.layer_of_key = {k: layer for layer in self.layers
                             for k in travelling(element_keys(model, layer), settings)}
        self.static = settings.method_settings.mode == "static"
        super().__init__(model, settings)

    def select_always_personal(self, model: nn.Module) -> list[str]:
        return list(self.layer_of_key)

    def select_personal(self, model: nn.Module) -> list[str]:
        # a quantile below 0 shares every element: nothing stays personal
        return [] if self.settings.method_settings.tau_quantile < 0 else self.always_personal

    # ------------------------------------------------------------------ downlink
    def pack_downlink(self, arrays: ArrayRecord, split: dict[str, np.ndarray]) -> ArrayRecord:
        """Server side: the analysed layers' shared rows, every other key whole, the masks."""
        out = {name: (Array(value.numpy()[split[self.layer_of_key[name]]])
                      if name in self.layer_of_key else value) for name, value in arrays.items()}
        for layer, mask in split.items():
            out[f"{MASK_PREFIX}{layer}"] = Array(mask.astype(np.uint8))
        return ArrayRecord(out)

    @staticmethod
    def masks_of(received: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Client side: the split that came with a downlink (layer -> bool rows)."""
        return {k[len(MASK_PREFIX):]: torch.as_tensor(v).bool() for k, v in received.items()
                if k.startswith(MASK_PREFIX)}

    def merge_downlink(self, own: dict[str, Tensor], incoming: dict[str, Tensor]
                       ) -> dict[str, Tensor]:
        """Shared rows from the server into this client's own tensors; personal rows stay."""
        masks = self.masks_of(incoming)
        merged = dict(own)
        plain = {}
        for name, value in incoming.items():
            if name.startswith(MASK_PREFIX):
                continue
            layer = self.layer_of_key.get(name)
            if layer not in masks:
                plain[name] = value
                continue
            rows = masks[layer]
            if name not in own or value.shape != (int(rows.sum()), *own[name].shape[1:]):
                raise ValueError(f"received array {name!r} does not fit the shared rows")
            merged[name] = own[name].clone()
            merged[name][rows] = value
        return super().merge_downlink(merged, plain)

    # ------------------------------------------------------------------ uplink
    def uplink_masks(self, received: Mapping[str, Tensor]) -> Masks | None:
        masks = self.masks_of(received)
        return masks if self.static and masks else None

    def uplink_spec(self, info: Mapping[str, Any], masks: Masks | None) -> ArraySpec:
        if masks is None:
            return self.shared_spec
        spec = dict(self.shared_spec)
        for name, layer in self.layer_of_key.items():
            shape, dtype = spec[name]
            spec[name] = ((int(masks[layer].sum()), *shape[1:]), dtype)
        return spec

    def cut(self, name: str, tensor: Tensor, masks: Masks | None) -> Tensor:
        layer = self.layer_of_key.get(name)
        return tensor if masks is None or layer is None else tensor[masks[layer]]

    def put(self, name: str, tensor: Tensor, part: Tensor, masks: Masks | None) -> None:
        layer = self.layer_of_key.get(name)
        if masks is None or layer is None:
            tensor.copy_(part)
        else:
            tensor[masks[layer].to(tensor.device)] = part
