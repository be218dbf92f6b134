"""Factorized-FL's model transform: every body Linear/Conv2d becomes rank-1 plus a sparse bias.

Jeong and Hwang, "Factorized-FL: Agnostic Personalized Federated Learning with Kernel
Factorization & Similarity Matching" (NeurIPS 2022). Created at initialisation and trained
directly (no decomposition of a trained model).

- Linear with ``I`` inputs, ``O`` outputs: ``W = u v^T + mu`` with ``u`` in R^I, ``v`` in R^O,
  ``mu`` in R^{I x O}; in PyTorch's ``O x I`` layout ``W[o, i] = v[o] u[i] + mu[o, i]``.
- Conv2d ``O x I x K x K``: ``u`` in R^{K*K} is a spatial basis kernel, ``v`` in R^{O x I} the
  per-channel-pair coefficients: ``W[o, i] = v[o, i] * reshape(u, K, K) + mu[o, i]``. (The
  authors' ``.view`` of the ``(K*K) x (O*I)`` product loses this meaning; here ``v = 1`` gives
  every ``W[o, i]`` the same ``K x K`` kernel ``u``, as the paper intends.)
- ``mu`` starts at zero; the local loss adds ``factorized-fl.l1 * ||mu||_1`` with a real
  gradient. ``u``, ``v`` are Gaussian, scaled so that ``W`` starts with the usual
  ``1/sqrt(fan_in)`` spread.

Which layers: every Linear and Conv2d under ``body``; the classifier ``head`` stays a plain
Linear (personal: see ``strategies/factorized_fl/spec.py``). Biases and BatchNorm are unchanged.
State-dict names: ``<layer>.u``, ``<layer>.v``, ``<layer>.mu``, ``<layer>.bias``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from common.config import ConfigError
from models.backbones import forward_calls


class FactorizedLinear(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        scale = self.in_features ** -0.25  # std(W) = std(u) std(v) = 1/sqrt(I)
        self.u = nn.Parameter(torch.randn(self.in_features) * scale)
        self.v = nn.Parameter(torch.randn(self.out_features) * scale)
        self.mu = nn.Parameter(torch.zeros(self.out_features, self.in_features))
        self.bias = nn.Parameter(base.bias.detach().clone()) if base.bias is not None else None

    def weight(self) -> Tensor:
        return torch.outer(self.v, self.u) + self.mu

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight(), self.bias)


class FactorizedConv2d(nn.Module):
    def __init__(self, base: nn.Conv2d) -> None:
        super().__init__()
        self.stride, self.padding, self.dilation = base.stride, base.padding, base.dilation
        self.kernel_size = base.kernel_size
        out_c, in_c, kh, kw = base.weight.shape
        self.u = nn.Parameter(torch.randn(kh * kw))
        self.v = nn.Parameter(torch.randn(out_c, in_c) / math.sqrt(in_c * kh * kw))
        self.mu = nn.Parameter(torch.zeros(out_c, in_c, kh, kw))
        self.bias = nn.Parameter(base.bias.detach().clone()) if base.bias is not None else None

    def weight(self) -> Tensor:
        kernel = self.u.view(*self.kernel_size)
        return self.v[:, :, None, None] * kernel + self.mu

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight(), self.bias, self.stride, self.padding, self.dilation)


FACTORIZED = (FactorizedLinear, FactorizedConv2d)


def factorize(model: nn.Module) -> nn.Module:
    """Replace every Linear and Conv2d of ``model.body`` in place by its factorized twin."""
    for prefix, parent in list(model.body.named_modules(prefix="body")):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, FactorizedLinear(child))
            elif isinstance(child, nn.Conv2d):
                if child.groups != 1 or child.padding_mode != "zeros":
                    raise ConfigError(
                        f"model: Factorized-FL factorizes ungrouped, zero-padded Conv2d "
                        f"layers only; {prefix}.{name} has groups {child.groups} and padding "
                        f"mode {child.padding_mode!r}: choose another model or method")
                setattr(parent, name, FactorizedConv2d(child))
    return model


def factorized_layers(model: nn.Module) -> list[str]:
    """Module names of the factorized layers, in registration order."""
    return [name for name, m in model.named_modules() if isinstance(m, FACTORIZED)]


def matching_key(model: nn.Module, input_shape: tuple[int, ...]) -> str:
    """The matching vector: ``v`` of the factorized layer that runs last before the
    classifier (the paper's penultimate layer), found by running ``model`` once on a batch of
    ``input_shape`` zeros, since a user's model may register its layers out of forward order."""
    _, calls = forward_calls(model, input_shape, FACTORIZED)
    return f"{calls[-1][0]}.v"


def l1_of_mu(model: nn.Module) -> Tensor:
    return sum(p.abs().sum() for name, p in model.named_parameters() if name.endswith(".mu"))
