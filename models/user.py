"""A user's own model, ``model = "package.module:factory"``, adopted as a ``Backbone``.

The factory is any importable callable ``factory(input_shape, num_classes)`` returning a
``torch.nn.Module`` (``input_shape`` is ``(C, H, W)`` for images, ``(D,)`` for vectors). It is
called under the run's seed on the server and on every site, so it must build the same model
from the same seed.

The methods need the model as ``body`` (the representation) and ``head`` (the classifier that
FedPer/FedRep keep on the client and pFedC replaces by branches). The rule: **the classifier is
the ``nn.Linear`` whose output ``forward`` returns**, found by one forward pass of a zero
batch, whatever order the layers were registered in; the body is the model itself with that
Linear replaced by an identity. A model the rule cannot serve (its ``forward`` returns
something else, e.g. a softmax, or calls the classifier twice) is refused with one line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import Tensor, nn

from common.config import ConfigError
from models.backbones import Backbone, forward_calls

FACTORY_FORM = "'package.module:factory' (a callable taking input_shape, num_classes)"


def is_factory(name: str) -> bool:
    """``model`` names a user's factory (``module:attribute``) rather than a built-in."""
    return ":" in name


def load_factory(spec: str) -> Callable[..., nn.Module]:
    """The callable ``spec`` names; a one-line ``ConfigError`` if it cannot be imported."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"model: {spec!r} is not of the form {FACTORY_FORM}")
    try:
        found: object = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"model: cannot import {module_name!r} ({error}); it must be "
                          "importable on the server and on every site (installed in their "
                          "environment, or on PYTHONPATH)") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ConfigError(f"model: {module_name!r} has no {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"model: {spec!r} is not callable; expected {FACTORY_FORM}")
    return found


def build_user_backbone(spec: str, input_shape: tuple[int, ...], num_classes: int
                        ) -> Backbone:
    """Call the factory and split its model into ``body`` and ``head`` (module docstring)."""
    model = load_factory(spec)(tuple(input_shape), num_classes)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model: {spec!r} returned a {type(model).__name__}, not a "
                          "torch.nn.Module")
    name, head = find_classifier(spec, model, input_shape, num_classes)
    if not name:  # the model is one Linear: no representation
        return Backbone(nn.Identity(), head.in_features, num_classes, head=head)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, nn.Identity())
    return Backbone(model, head.in_features, num_classes, head=head)


def find_classifier(spec: str, model: nn.Module, input_shape: tuple[int, ...],
                    num_classes: int) -> tuple[str, nn.Linear]:
    """The name and module of the ``nn.Linear`` whose output ``model`` returns."""
    try:
        output, calls = forward_calls(model, input_shape, nn.Linear)
    except Exception as error:  # the user's forward: any failure is reported in one line
        raise ConfigError(f"model: {spec!r} fails on a batch of shape {(2, *input_shape)}: "
                          f"{type(error).__name__}: {str(error).splitlines()[0]}") from None
    if not isinstance(output, Tensor) or tuple(output.shape) != (2, num_classes):
        shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
        raise ConfigError(f"model: {spec!r} returns {shape} for a batch of 2; expected "
                          f"logits of shape (2, {num_classes})")
    returned = [(name, inputs) for name, inputs, out in calls if out is output]
    if not returned:
        raise ConfigError(f"model: {spec!r} does not return an nn.Linear's output; end its "
                          "forward with the classifier, `return self.<classifier>(features)` "
                          "(FedPer/FedRep keep it personal, pFedC replaces it by branches)")
    name, inputs = returned[0]
    if sum(called == name for called, _, _ in calls) > 1 or inputs.dim() != 2:
        raise ConfigError(f"model: {spec!r}'s classifier {name!r} must be called once, on "
                          "(batch, features) inputs")
    return name, model.get_submodule(name)
