"""Ditto's model transform: the run's model twice, a global copy and a personal one.

Li et al., "Ditto: Fair and Robust Federated Learning Through Personalization" (ICML 2021).
``shared`` is the global model ``w`` (FedAvg's, under ``shared.<its state-dict name>``);
``personal`` is the client's own ``v`` (``personal.<name>``), which never leaves the client.
Both start as the same seeded model. ``forward`` is the personal model's: what a client is
scored with.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

SHARED, PERSONAL = "shared", "personal"


class Ditto(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.shared = model
        self.personal = copy.deepcopy(model)

    def forward(self, x: Tensor) -> Tensor:
        return self.personal(x)


def twin(model: nn.Module) -> Ditto:
    """``model`` as Ditto's global copy, beside an identical personal one."""
    return Ditto(model)


def is_personal_key(key: str) -> bool:
    """The personal model's entries: they never leave the client."""
    return key.startswith(f"{PERSONAL}.")
