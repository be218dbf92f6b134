"""FedDecomp's model transform: every Linear and Conv2d weight becomes ``sigma + tau``.

Wu et al., "Decoupling General and Personalized Knowledge in Federated Learning via Additive
and Low-rank Decomposition" (ACM MM 2024). ``sigma`` is the layer's full-rank weight, shared;
``tau = B A`` is low-rank and personal. ``B`` starts at zero and ``A`` random, so at
initialisation the decomposed model computes exactly what the original did.

State-dict names: ``sigma`` keeps the original name (``<layer>.weight``), so the shared part
of a decomposed model has FedAvg's keys and bytes; ``<layer>.lora_A`` / ``<layer>.lora_B`` are
``A`` and ``B``.

Shapes, with ``I`` inputs and ``O`` outputs (the paper's convention):
- Linear: ``B`` is ``I x r``, ``A`` is ``r x O``; ``r`` is ``rank-linear`` itself where it is an
  integer (the authors' ``--Linear_r``, an absolute rank), else
  ``max(1, round(rank-linear * min(I, O)))``; ``tau = (B A)^T`` in PyTorch's ``O x I`` layout.
- Conv2d with ``K x K`` kernels: ``B A`` lives on the ``(I*K) x (O*K)`` matrix,
  ``r = max(1, round(rank-conv * min(I, O) * K))``; it is viewed as ``(I, K, O, K)`` and
  permuted to PyTorch's ``(O, I, K, K)`` kernel (row index = input channel and kernel row,
  column index = output channel and kernel column).

The scale ``s`` of ``tau = s * B A`` (``feddecomp.tau-scale``):
- ``"authors"`` (default): the authors' loralib, ``lora_alpha / r`` with ``lora_alpha = 1`` and
  ``r`` counted as they count it: a Linear's rank, and for a Conv2d ``int(rank-conv * O)``,
  the rank their code is given before it multiplies it by the kernel size (so a conv's scale
  does not shrink with ``I`` or ``K``). On LeNet-5 with ``rank-conv = 0.5`` and
  ``rank-linear = 4``: 1/3, 1/8, 1/4, 1/4, 1/4.
- ``"inverse-rank"``: ``1 / r`` with this project's ``r`` above (on the same LeNet-5 with
  ``rank-linear = 0.5``: 1/2, 1/15, 1/60, 1/42, 1/5).
- ``"none"``: ``s = 1``.
A scale below 1 acts as a smaller learning rate on ``tau`` (the gradient reaching ``B`` and
``A`` is scaled by ``s`` and so is their product's effect). ``A`` is initialised like LoRA
(Kaiming-uniform), ``B`` with zeros.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from common.config import ConfigError

TAU_SCALES = ("authors", "inverse-rank", "none")


def _init_factors(module: nn.Module, rows: int, rank: int, cols: int, scale: float) -> None:
    module.scale = scale
    module.lora_B = nn.Parameter(torch.zeros(rows, rank))
    module.lora_A = nn.Parameter(torch.empty(rank, cols))
    nn.init.kaiming_uniform_(module.lora_A, a=math.sqrt(5))


class DecomposedLinear(nn.Linear):
    """``y = x (sigma + tau)^T + b`` with ``tau = (B A)^T``."""

    def __init__(self, base: nn.Linear, rank: int | float, tau_scale: str) -> None:
        """``rank``: an int is the rank itself, a float a ratio of ``min(I, O)``."""
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.load_state_dict(base.state_dict())
        self.rank = (rank if isinstance(rank, int) else
                     max(1, round(rank * min(self.in_features, self.out_features))))
        # the authors' r of a Linear is its rank: their scale is this one
        scale = 1.0 if tau_scale == "none" else 1.0 / self.rank
        _init_factors(self, self.in_features, self.rank, self.out_features, scale)

    def tau(self) -> Tensor:
        return (self.lora_B @ self.lora_A).T * self.scale

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight + self.tau(), self.bias)


class DecomposedConv2d(nn.Conv2d):
    """A Conv2d whose kernel is ``sigma + tau``, ``tau`` from ``B A`` on ``(I*K) x (O*K)``."""

    def __init__(self, base: nn.Conv2d, ratio: float, tau_scale: str) -> None:
        super().__init__(base.in_channels, base.out_channels, base.kernel_size, base.stride,
                         base.padding, base.dilation, base.groups, base.bias is not None,
                         base.padding_mode)
        self.load_state_dict(base.state_dict())
        k = self.kernel_size[0]
        self.rank = max(1, round(ratio * min(self.in_channels, self.out_channels) * k))
        counted = {"authors": max(1, int(ratio * self.out_channels)), "inverse-rank": self.rank,
                   "none": 1}[tau_scale]
        _init_factors(self, self.in_channels * k, self.rank, self.out_channels * k, 1.0 / counted)

    def tau(self) -> Tensor:
        k, cin, cout = self.kernel_size[0], self.in_channels, self.out_channels
        product = (self.lora_B @ self.lora_A) * self.scale
        return product.view(cin, k, cout, k).permute(2, 0, 1, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self._conv_forward(x, self.weight + self.tau(), self.bias)


def decompose(model: nn.Module, rank_conv: float, rank_linear: int | float,
              tau_scale: str) -> nn.Module:
    """Replace every Linear and Conv2d of ``model`` in place by its decomposed twin, with
    the rank ratio ``rank_conv``, the Linear rank (int) or ratio (float) ``rank_linear`` and
    the scale rule ``tau_scale`` (``TAU_SCALES``)."""
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, DecomposedLinear(child, rank_linear, tau_scale))
            elif isinstance(child, nn.Conv2d):
                if child.kernel_size[0] != child.kernel_size[1] or child.groups != 1:
                    layer = f"{prefix}.{name}".lstrip(".")
                    raise ConfigError(
                        f"model: FedDecomp decomposes square, ungrouped Conv2d layers only; "
                        f"{layer} has kernel {child.kernel_size} and groups {child.groups}: "
                        "choose another model or method")
                setattr(parent, name, DecomposedConv2d(child, rank_conv, tau_scale))
    return model


def is_personal_key(key: str) -> bool:
    """``tau``'s factors: they never leave the client."""
    return key.rsplit(".", 1)[-1] in ("lora_A", "lora_B")
