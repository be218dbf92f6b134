"""pFedC's local rule: multi-task training of ``phi`` and the branches, weighted by MGDA-UB.

Local objective ``L_i = sum_t lambda_t L_t(phi, omega^t)`` over all ``T`` tasks (a task whose
classes the client lacks still trains its branch towards "other": that branch is personal).
``pfedc.mgda = false``: ``lambda_t = 1/T``. ``pfedc.mgda = true`` (Sener and Koltun 2018,
MGDA-UB): per batch, the gradients ``g_t`` of every ``L_t`` with respect to the shared
representation ``z = phi(x)`` are normalised by ``L_t * ||g_t||`` (the reference code's
``loss+``), ``lambda`` is the min-norm point of their convex hull, and one backward pass of
``sum_t lambda_t L_t`` updates everything.
"""

from __future__ import annotations

import numpy as np
import torch

from strategies.pfedc.spec import PFedCSettings
from strategies.training import LocalTraining, sgd


def min_norm_weights(gram: np.ndarray) -> np.ndarray:
    """``argmin_{lambda in simplex} ||sum_t lambda_t g_t||^2`` given the Gram matrix
    ``gram[s, t] = <g_s, g_t>``: a small QP solved with SciPy's SLSQP (closed form for two)."""
    n = gram.shape[0]
    if n == 1:
        return np.ones(1)
    if n == 2:
        diff = gram[0, 0] - 2 * gram[0, 1] + gram[1, 1]
        w = 0.5 if diff <= 0 else float(np.clip((gram[1, 1] - gram[0, 1]) / diff, 0, 1))
        return np.array([w, 1 - w])
    from scipy.optimize import minimize  # SciPy's optimiser loads slowly: only for T > 2

    scale = max(float(np.abs(gram).max()), 1e-12)
    g = gram / scale
    result = minimize(lambda w: w @ g @ w, np.full(n, 1 / n), jac=lambda w: 2 * g @ w,
                      method="SLSQP", bounds=[(0, 1)] * n,
                      constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1,
                                    "jac": lambda w: np.ones_like(w)}],
                      options={"ftol": 1e-12, "maxiter": 200})
    weights = np.clip(result.x, 0, None)
    return weights / weights.sum()


def mgda_ub_weights(losses: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """MGDA-UB task weights from the gradients of each loss (``losses``: shape ``(T,)``)
    with respect to the representation ``z``; all ``T`` gradients in one batched backward."""
    one_per_task = torch.eye(len(losses), dtype=losses.dtype, device=losses.device)
    (grads,) = torch.autograd.grad(losses, z, grad_outputs=one_per_task, retain_graph=True,
                                   is_grads_batched=True)
    grads = grads.flatten(1)
    grads = grads / (losses.detach().clamp_min(1e-8)
                     * grads.norm(dim=1).clamp_min(1e-12)).unsqueeze(1)
    gram = (grads @ grads.T).double().cpu().numpy()
    return torch.as_tensor(min_norm_weights(gram), dtype=z.dtype, device=z.device)


def train_pfedc(job: LocalTraining[PFedCSettings]) -> float:
    model, settings = job.model, job.settings
    use_mgda = settings.method_settings.mgda
    optimizer = sgd(model.parameters(), settings)
    model.train()
    total, batches = 0.0, 0
    for _ in range(settings.local_epochs):
        for x, y in job.loader:
            x, y = x.to(job.device), y.to(job.device)
            optimizer.zero_grad(set_to_none=True)
            z = model.features(x)
            losses = model.head.task_losses(z, y)
            if use_mgda and len(losses) > 1:
                objective = mgda_ub_weights(losses, z) @ losses
            else:
                objective = losses.mean()  # equal weights 1/T
            objective.backward()
            optimizer.step()
            total += float(losses.detach().mean())
            batches += 1
    return total / max(batches, 1)
