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
- Initialisation (``factorized-fl.mu-init``). ``"xavier"`` (default): as the authors' code, ``mu``
  is Xavier-uniform like a plain layer's weight, so the layer starts full-rank, and ``u``, ``v``
  are Xavier-uniform on their own shapes (``u`` as an ``I x 1`` / ``K*K x 1`` matrix, ``v`` as
  ``1 x O`` / ``1 x (O*I)``), which makes ``u v^T`` a small addition (spectral norm about 2).
  The authors simply add the two, so ``W``'s variance is ``1 + var(u v^T) / var(mu)`` times a
  Xavier layer's: a few percent more on wide layers, but 2.8 times on a one-channel first
  convolution (1 -> 32 channels, 3 x 3). Here all three are scaled by one factor so that ``W``
  has exactly the Xavier variance ``2 / (fan_in + fan_out)`` in every layer, keeping the
  authors' proportion of ``u v^T`` to ``mu`` (``_xavier_factors``). The authors leave a
  convolution's ``mu`` at zero (their Xavier line is commented out); in their reshaping the
  product is a scrambled kernel, but with the paper's ``u = spatial`` meaning kept here a zero
  ``mu`` would start every kernel ``W[o, i]`` as the same ``K x K`` pattern ``u``, so convolutions
  get a Xavier ``mu`` too. ``"zeros"``: the previous behaviour, ``mu = 0`` and Gaussian ``u``,
  ``v`` scaled so that ``W = u v^T`` alone has the ``1/sqrt(fan_in)`` spread (a rank-1 start).
- The local loss adds ``factorized-fl.l1 * ||mu||_1`` with a real gradient (the paper's
  objective; the authors' code takes it from a detached state dict, so there it does nothing),
  and nothing at all when ``l1 = 0``.

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

MU_INITS = ("xavier", "zeros")


def _uniform(shape: tuple[int, ...], variance: float) -> Tensor:
    bound = math.sqrt(3 * variance)  # U(-b, b) has variance b^2 / 3
    return torch.empty(shape).uniform_(-bound, bound)


def _xavier_factors(u_len: int, v_shape: tuple[int, ...], mu_shape: tuple[int, ...],
                    fan_in: int, fan_out: int) -> tuple[Tensor, Tensor, Tensor]:
    """``u``, ``v``, ``mu`` for ``mu-init = "xavier"``: the authors' Xavier-uniform factors
    (``u`` as a ``u_len x 1`` matrix, ``v`` as ``1 x numel(v)``) and Xavier-uniform ``mu``, all
    scaled by one factor so that ``W = u v^T + mu`` has exactly the Xavier variance
    ``2 / (fan_in + fan_out)`` (the plain sum has ``1 + var(u v^T) / var(mu)`` times that)."""
    target = 2 / (fan_in + fan_out)                         # a Xavier layer's variance
    var_u, var_v = 2 / (u_len + 1), 2 / (math.prod(v_shape) + 1)  # xavier_uniform, n x 1
    shrink = target / (target + var_u * var_v)              # var(mu) + var(u) var(v) -> target
    u = _uniform((u_len,), var_u * math.sqrt(shrink))
    v = _uniform(v_shape, var_v * math.sqrt(shrink))
    mu = _uniform(mu_shape, target * shrink)
    return u, v, mu


class FactorizedLinear(nn.Module):
    def __init__(self, base: nn.Linear, mu_init: str = "xavier") -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        if mu_init == "xavier":
            u, v, mu = _xavier_factors(self.in_features, (self.out_features,),
                                       (self.out_features, self.in_features),
                                       self.in_features, self.out_features)
        else:  # "zeros": W = u v^T alone, std(W) = std(u) std(v) = 1/sqrt(I)
            scale = self.in_features ** -0.25
            u = torch.randn(self.in_features) * scale
            v = torch.randn(self.out_features) * scale
            mu = torch.zeros(self.out_features, self.in_features)
        self.u, self.v, self.mu = nn.Parameter(u), nn.Parameter(v), nn.Parameter(mu)
        self.bias = nn.Parameter(base.bias.detach().clone()) if base.bias is not None else None

    def weight(self) -> Tensor:
        return torch.outer(self.v, self.u) + self.mu

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight(), self.bias)


class FactorizedConv2d(nn.Module):
    def __init__(self, base: nn.Conv2d, mu_init: str = "xavier") -> None:
        super().__init__()
        self.stride, self.padding, self.dilation = base.stride, base.padding, base.dilation
        self.kernel_size = base.kernel_size
        out_c, in_c, kh, kw = base.weight.shape
        if mu_init == "xavier":
            u, v, mu = _xavier_factors(kh * kw, (out_c, in_c), (out_c, in_c, kh, kw),
                                       in_c * kh * kw, out_c * kh * kw)
        else:  # "zeros": W = v u alone, std(W) = 1/sqrt(fan_in)
            u = torch.randn(kh * kw)
            v = torch.randn(out_c, in_c) / math.sqrt(in_c * kh * kw)
            mu = torch.zeros(out_c, in_c, kh, kw)
        self.u, self.v, self.mu = nn.Parameter(u), nn.Parameter(v), nn.Parameter(mu)
        self.bias = nn.Parameter(base.bias.detach().clone()) if base.bias is not None else None

    def weight(self) -> Tensor:
        kernel = self.u.view(*self.kernel_size)
        return self.v[:, :, None, None] * kernel + self.mu

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(x, self.weight(), self.bias, self.stride, self.padding, self.dilation)


FACTORIZED = (FactorizedLinear, FactorizedConv2d)


def factorize(model: nn.Module, mu_init: str = "xavier") -> nn.Module:
    """Replace every Linear and Conv2d of ``model.body`` in place by its factorized twin,
    initialised as ``mu_init`` says (module docstring)."""
    for prefix, parent in list(model.body.named_modules(prefix="body")):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, FactorizedLinear(child, mu_init))
            elif isinstance(child, nn.Conv2d):
                if child.groups != 1 or child.padding_mode != "zeros":
                    raise ConfigError(
                        f"model: Factorized-FL factorizes ungrouped, zero-padded Conv2d "
                        f"layers only; {prefix}.{name} has groups {child.groups} and padding "
                        f"mode {child.padding_mode!r}: choose another model or method")
                setattr(parent, name, FactorizedConv2d(child, mu_init))
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


# the train metric a client reports it under, and the round's figure in results.json
MU_DENSITY = "mu-density"
# |mu| at most this counts as zero: SGD with an L1 term reaches no exact zero
MU_ZERO = 1e-3


def mu_density(model: nn.Module) -> float:
    """The share of the elements of every ``mu`` whose magnitude exceeds ``MU_ZERO``: how
    dense the personal part is (the paper's ``mu`` is meant to be a sparse bias)."""
    mus = [p.detach() for name, p in model.named_parameters() if name.endswith(".mu")]
    total = sum(m.numel() for m in mus)
    return float(sum(int((m.abs() > MU_ZERO).sum()) for m in mus) / total) if total else 0.0
