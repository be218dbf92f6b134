"""FedFac's view of a model: which layers are analysed and which parameters make an element.

``fedfac.layers`` is a comma-separated list of Linear/Conv2d layers, each either an index into
the model's Linear and Conv2d layers in forward (registration) order (``"0"`` = the first;
``"-1"`` = the classifier ``head``) or a module name (``"body.0"``). The hidden elements of a
layer are its output neurons (Linear) or channels (Conv2d). Element ``j``'s parameters are the
weights that produce it (row ``j`` of a Linear weight, kernel ``j`` of a Conv2d weight), its bias
entry, and entry ``j`` of the BatchNorm that directly follows the layer (affine parameters and
running statistics). FedFac uses no model transform: the backbone is unchanged.
"""

from __future__ import annotations

from torch import nn

from common.config import ConfigError

WEIGHTED = (nn.Linear, nn.Conv2d)


def weighted_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, WEIGHTED)]


def analysed_layers(model: nn.Module, spec: str) -> list[str]:
    """Module names named by ``fedfac.layers`` (indices or names, comma-separated)."""
    names = weighted_layers(model)
    chosen = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item.lstrip("-").isdigit():
            index = int(item)
            if not -len(names) <= index < len(names):
                raise ConfigError(f"fedfac.layers: index {index} is out of range; allowed: "
                                  f"[-{len(names)}, {len(names) - 1}] over {names}")
            chosen.append(names[index])
        elif item in names:
            chosen.append(item)
        else:
            raise ConfigError(f"fedfac.layers: unknown layer {item!r}; allowed: indices or "
                              f"{', '.join(names)}")
    if not chosen:
        raise ConfigError("fedfac.layers: empty; allowed: indices or layer names")
    return list(dict.fromkeys(chosen))


def element_keys(model: nn.Module, layer: str) -> list[str]:
    """State-dict keys indexed (on dim 0) by the layer's elements."""
    modules = list(model.named_modules())
    position = next(i for i, (name, _) in enumerate(modules) if name == layer)
    module = modules[position][1]
    keys = [f"{layer}.weight"] + ([f"{layer}.bias"] if module.bias is not None else [])
    width = module.weight.shape[0]
    for name, follower in modules[position + 1:]:
        if isinstance(follower, WEIGHTED):
            break
        if isinstance(follower, nn.modules.batchnorm._BatchNorm):
            if follower.num_features == width:
                keys += [f"{name}.{k}" for k in ("weight", "bias", "running_mean",
                                                 "running_var")]
            break
    return keys
