"""What a method is made of (contracts §7): the ``Method`` record and its default hooks.

This module imports no method, so every method module can import it; the registry
(``strategies/registry.py``) imports the methods.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import RecordDict
from torch import nn

from client_app.training import LocalTraining
from common.config import RunSettings
from fldata import ClientData
from strategies.base import PersonalizedStrategy


def keep_model(model: nn.Module, settings: RunSettings) -> nn.Module:
    return model


def no_checks(settings: RunSettings) -> None:
    return None


def same_keys(model: nn.Module, keys: list[str], data: ClientData,
              settings: RunSettings) -> list[str]:
    return keys


def nothing_to_report(data: ClientData, settings: RunSettings) -> dict[str, Any]:
    return {}


def overlay(model: nn.Module, own: dict[str, torch.Tensor], incoming: dict[str, torch.Tensor],
            settings: RunSettings) -> dict[str, torch.Tensor]:
    """The received arrays replace the client's own entries (same keys, same shapes)."""
    for key, value in incoming.items():
        if key not in own or own[key].shape != value.shape:
            raise ValueError(f"received array {key!r} does not fit the model")
    return {**own, **incoming}


def as_is(model: nn.Module, arrays: dict[str, torch.Tensor], received: dict[str, torch.Tensor],
          settings: RunSettings) -> dict[str, torch.Tensor]:
    return arrays


def nothing_more(model: nn.Module, settings: RunSettings) -> list[str]:
    return []


@dataclass(frozen=True)
class Method:
    """A method's pieces. ``shared_keys`` names the keys the server sends (its initial
    arrays); ``uplink_keys`` turns them into what one client sends back, given its data (pFedC:
    only the branches of the classes it holds; Factorized-FL: plus its matching vector);
    ``client_info`` adds values to the reply's ``client`` ConfigRecord (visible to the
    server, so document them). For methods that share parts of tensors (FedFac):
    ``merge_received`` puts the received arrays into the client's own state,
    ``shape_uplink`` cuts the uplink arrays, and ``always_personal`` names tensors the client
    keeps even when they also travel. ``actions`` answers the server's ``query`` messages
    (``action`` name -> ``handler(client, message) -> RecordDict``)."""

    name: str
    strategy: type[PersonalizedStrategy]
    local_train: Callable[[LocalTraining], float]
    shared_keys: Callable[[nn.Module, RunSettings], list[str]]
    transform: Callable[[nn.Module, RunSettings], nn.Module] = keep_model
    validate: Callable[[RunSettings], None] = no_checks
    uplink_keys: Callable[[nn.Module, list[str], ClientData, RunSettings], list[str]] = same_keys
    client_info: Callable[[ClientData, RunSettings], dict[str, Any]] = nothing_to_report
    merge_received: Callable[..., dict[str, torch.Tensor]] = overlay
    shape_uplink: Callable[..., dict[str, torch.Tensor]] = as_is
    always_personal: Callable[[nn.Module, RunSettings], list[str]] = nothing_more
    actions: dict[str, Callable[..., RecordDict]] = field(default_factory=dict)
