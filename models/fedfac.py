"""FedFac's view of a model: which layers are analysed and which parameters make an element.

``fedfac.layers`` is a comma-separated list of Linear/Conv2d layers, each either an index or a
module name (``"body.0"``). Indices count the layers in the order ``forward`` runs them
(``forward_layers``), found by one forward pass of a zero batch, so they mean the same on a
model that registers its layers in another order: ``"0"`` is the first layer, ``"-1"`` the
classifier ``head`` and ``"-2"`` the layer that runs just before it (the default: the deepest
hidden layer, as in the paper, section 5.3, and the authors' scripts: ResNet-18's last conv,
VGG16's last hidden Linear, the Shakespeare LSTM's hidden Linear). A layer that reads the very
tensor an earlier layer read (a residual block's projection shortcut, which reads the block's
input, and runs after the block's second conv) is a side branch: it has no index and is chosen
by name. The classifier is refused: FedFac splits the hidden elements of a layer (the paper's
hidden neurons/channels), and no script of the authors splits the classifier's outputs
(classes).

The hidden elements of a layer are its output neurons (Linear) or channels (Conv2d). Element
``j``'s parameters are the weights that produce it (row ``j`` of a Linear weight, kernel ``j``
of a Conv2d weight), its bias entry, and entry ``j`` of the BatchNorm that directly follows the
layer (affine parameters and running statistics): the first BatchNorm registered after the
layer, before any other Linear/Conv2d, if it has the layer's width (every backbone here
and the usual ``nn.Sequential`` and ResNet blocks register a norm right after its layer).
FedFac uses no model transform: the backbone is unchanged.
"""

from __future__ import annotations

from torch import nn

from common.config import ConfigError
from models.backbones import forward_calls

WEIGHTED = (nn.Linear, nn.Conv2d)
CLASSIFIER = "head"  # the Backbone's classifier (a user's model is adopted with it as head)


def weighted_layers(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, WEIGHTED)]


def forward_layers(model: nn.Module, input_shape: tuple[int, ...]) -> list[str]:
    """The Linear and Conv2d layers that ``fedfac.layers`` indices count: in the order
    ``forward`` runs them on a zero batch of ``input_shape``, each once, without side branches
    (a layer whose input is the same tensor an earlier layer read); the classifier last."""
    _, calls = forward_calls(model, input_shape, WEIGHTED)
    order: list[str] = []
    for position, (name, inputs, _) in enumerate(calls):
        side_branch = any(inputs is earlier for _, earlier, _ in calls[:position])
        if name not in order and name != CLASSIFIER and not side_branch:
            order.append(name)
    return order + ([CLASSIFIER] if any(name == CLASSIFIER for name, _, _ in calls) else [])


def analysed_layers(model: nn.Module, spec: str, input_shape: tuple[int, ...]) -> list[str]:
    """Module names named by ``fedfac.layers`` (indices or names, comma-separated); indices
    into ``forward_layers(model, input_shape)``."""
    names = weighted_layers(model)
    order = forward_layers(model, input_shape)
    chosen = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        if item.lstrip("-").isdigit():
            index = int(item)
            if not -len(order) <= index < len(order):
                raise ConfigError(f"fedfac.layers: index {index} is out of range; allowed: "
                                  f"[-{len(order)}, {len(order) - 1}] over the layers in "
                                  f"forward order {order}")
            name = order[index]
        elif item in names:
            name = item
        else:
            raise ConfigError(f"fedfac.layers: unknown layer {item!r}; allowed: indices or "
                              f"{', '.join(n for n in names if n != CLASSIFIER)}")
        if name == CLASSIFIER:
            raise ConfigError(f"fedfac.layers: {item!r} is the classifier {CLASSIFIER!r}; FedFac "
                              "splits the hidden elements of hidden layers, not the classes; "
                              f"allowed: the hidden layers {order[:-1]} (-2 is the last)")
        chosen.append(name)
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
