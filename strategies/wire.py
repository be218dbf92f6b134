"""A method's wire spec: what it sends down and up, declared once, used by both sides.

The ServerApp and every ClientApp build the same ``WireSpec`` from the run's seeded template
model. The client builds its reply with ``build_uplink`` and puts the received arrays into its
own state with ``merge_downlink``; the server checks each reply against ``uplink_spec`` (the
same rule, given what the reply says in its ``client`` record and what the server sent). A
method whose payload differs from the default (every shared key, whole tensors, both ways)
overrides the hooks below in its ``strategies/<method>/spec.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic

import torch
from torch import Tensor, nn

from common.config import MethodSettingsT, RunSettings
from common.protocol import ArraySpec
from fldata import ClientData

Masks = Mapping[str, Any]
"""layer name -> boolean row mask (NumPy on the server, torch on a client)."""


def state_keys(model: nn.Module) -> list[str]:
    """Every state-dict entry except BatchNorm's batch counters (an int, meaningless to
    average)."""
    return [k for k in model.state_dict() if not k.endswith("num_batches_tracked")]


class WireSpec(Generic[MethodSettingsT]):
    """Default: every state-dict entry (``state_keys``) travels whole, both ways."""

    def __init__(self, model: nn.Module, settings: RunSettings[MethodSettingsT]) -> None:
        self.settings = settings
        self.shared_keys: list[str] = travelling(self.select_shared(model), settings)
        self.shared_spec: ArraySpec = tensor_spec(model.state_dict(), self.shared_keys)
        self.always_personal: list[str] = self.select_always_personal(model)
        self.personal_keys: list[str] = self.select_personal(model)

    # ------------------------------------------------------------------ declarations
    def select_shared(self, model: nn.Module) -> list[str]:
        """The keys the server holds and sends (its initial arrays)."""
        return state_keys(model)

    def select_always_personal(self, model: nn.Module) -> list[str]:
        """Tensors a client keeps even though they also travel (FedFac: partly personal
        tensors). Everything that is not both received and sent back is kept anyway."""
        return []

    def select_personal(self, model: nn.Module) -> list[str]:
        """What can stay on a client on this model: the keys never sent, and the tensors
        kept because they are partly personal. Empty: the method personalizes nothing here
        (FedBN on a model without BatchNorm), and the ServerApp warns at start."""
        sent = set(self.shared_keys)
        return [k for k in state_keys(model) if k not in sent] + self.always_personal

    def client_info(self, data: ClientData) -> dict[str, Any]:
        """Extra entries of the reply's ``client`` record (visible to the server: document
        them)."""
        return {}

    def uplink_masks(self, received: Mapping[str, Tensor]) -> Masks | None:
        """Client side: row masks the uplink is cut to, read from what was received (None:
        whole tensors)."""
        return None

    def uplink_spec(self, info: Mapping[str, Any], masks: Masks | None) -> ArraySpec:
        """key -> (shape, dtype) of exactly what a client's train reply carries, given its
        ``client`` record and the row masks. Raises ``ValueError`` for an ``info`` the rule
        cannot use (the server drops that reply)."""
        return self.shared_spec

    def cut(self, key: str, tensor: Tensor, masks: Masks | None) -> Tensor:
        """The part of ``tensor`` that goes up (default: all of it)."""
        return tensor

    def merge_downlink(self, own: dict[str, Tensor], incoming: dict[str, Tensor]
                       ) -> dict[str, Tensor]:
        """Client side: the received arrays replace the client's own entries (same keys,
        same shapes)."""
        for name, value in incoming.items():
            if name not in own or own[name].shape != value.shape:
                raise ValueError(f"received array {name!r} does not fit the model")
        return {**own, **incoming}

    # ------------------------------------------------------------------ the client's reply
    def keep_sent(self, state: dict[str, Tensor], uplink: Mapping[str, Tensor],
                  received: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Client side, under DP: ``state`` with what was sent in place of what was trained,
        so that the next update of an entry the client sends but does not receive back
        (Factorized-FL's matching vector, FedFac's personal rows in its dynamic mode) is
        measured from a value the server has seen, never from a clean one."""
        masks = self.uplink_masks(received)
        out = dict(state)
        for key, sent in uplink.items():
            full = out[key].detach().clone()
            self.put(key, full, sent.to(device=full.device, dtype=full.dtype), masks)
            out[key] = full
        return out

    def put(self, key: str, tensor: Tensor, part: Tensor, masks: Masks | None) -> None:
        """``cut``'s inverse: ``part`` written into ``tensor`` (in place) where it came from."""
        tensor.copy_(part)

    def build_uplink(self, state: dict[str, Tensor], received: Mapping[str, Tensor],
                     info: Mapping[str, Any]) -> dict[str, Tensor]:
        """What a client sends up: ``uplink_spec``'s keys, each ``cut``."""
        masks = self.uplink_masks(received)
        return {k: self.cut(k, state[k].detach().cpu(), masks)
                for k in self.uplink_spec(info, masks)}


def travelling(keys: list[str], settings: RunSettings) -> list[str]:
    """Of ``keys`` a method would send, those that may leave a client in this run: under DP,
    BatchNorm's running statistics stay on the client (docs/privacy.md): noise on a sum of
    variances can make one negative."""
    return [k for k in keys if not (settings.dp_mode and is_running_stat(k))]


def is_running_stat(key: str) -> bool:
    """A BatchNorm running statistic (``running_mean``, ``running_var``)."""
    return key.rsplit(".", 1)[-1].startswith("running_")


def tensor_spec(state: Mapping[str, Tensor], keys: list[str]) -> ArraySpec:
    """key -> (shape, dtype) of ``state[key]`` as it will travel (NumPy's dtype name), without
    copying the data (works on ``meta`` tensors)."""
    return {k: (tuple(state[k].shape), str(torch.empty(0, dtype=state[k].dtype).numpy().dtype))
            for k in keys}
