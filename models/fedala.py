"""FedALA's model transform: element-wise aggregation weights beside the higher layers.

Zhang et al., "FedALA: Adaptive Local Aggregation for Personalized Federated Learning" (AAAI
2023). Each of the ``fedala.layers`` parameter tensors nearest the output (counted in the
order ``forward`` runs their modules, whatever the registration order: ``forward_calls``)
gets a buffer ``W`` of its shape, ``<module>.ala_<name>`` (``head.ala_weight`` beside
``head.weight``), which starts at ones; the model's root gets ``ala_adapted``, 0 until the
client has adapted once. Both are personal: they never leave the client and live in its
personal state. The model computes what the backbone does: ``W`` is read only where a model
arrives (``strategies/fedala/client.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from models.backbones import forward_calls

PREFIX = "ala_"
ADAPTED = "ala_adapted"


def forward_order(model: nn.Module, input_shape: tuple[int, ...]) -> list[str]:
    """The names of ``model``'s parameter tensors in the order ``forward`` runs the modules
    that hold them (a module's own tensors in their registration order)."""
    _, calls = forward_calls(model, input_shape, nn.Module)
    order: list[str] = []
    for name, _, _ in calls:
        for leaf, _ in model.get_submodule(name).named_parameters(recurse=False):
            full = f"{name}.{leaf}" if name else leaf
            if full not in order:
                order.append(full)
    return order


def add_weights(model: nn.Module, input_shape: tuple[int, ...], layers: int) -> nn.Module:
    """``model`` with a weight buffer of ones beside each of its ``layers`` parameter tensors
    nearest the output, and the ``ala_adapted`` flag."""
    for name in forward_order(model, input_shape)[-layers:]:
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        module.register_buffer(f"{PREFIX}{leaf}", torch.ones_like(getattr(module, leaf)))
    model.register_buffer(ADAPTED, torch.zeros(()))
    return model


def weight_key(name: str) -> str:
    """The state-dict name of parameter ``name``'s weight buffer."""
    module_name, _, leaf = name.rpartition(".")
    return f"{module_name}.{PREFIX}{leaf}" if module_name else f"{PREFIX}{leaf}"


def adapted_names(model: nn.Module) -> list[str]:
    """The parameter tensors that have a weight buffer (the higher layers), in registration
    order."""
    keys = set(model.state_dict())
    return [name for name, _ in model.named_parameters() if weight_key(name) in keys]


def is_personal_key(key: str) -> bool:
    """The weights and the flag: they never leave the client."""
    return key.rsplit(".", 1)[-1].startswith(PREFIX)
