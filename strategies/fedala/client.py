"""FedALA's client side: adaptive local aggregation where the global model arrives, then
FedAvg's local training from the adapted model.

Where a model arrives (``adapt_fedala``, before the fused evaluation and the local rule), a
client that has a local model ``theta_local`` (its model after its last training) mixes the
received global model ``theta_global`` into it: the lower layers are the global model's as
they arrived; each of the ``fedala.layers`` parameter tensors nearest the output becomes

    theta = theta_local + (theta_global - theta_local) * W

with ``W`` element-wise in [0, 1] (``models/fedala.py``; ones at the start, so the first
mix is the global model, then the last round's ``W``). ``W`` is learned on a random
``fedala.data-fraction`` of the client's train split, drawn anew each time, with the
model's loss: a gradient step of size ``fedala.lr`` per batch (the gradient reaching ``W`` is
the tensor's gradient times ``theta_global - theta_local``), then clipped to [0, 1]. The
model is in eval mode meanwhile (BatchNorm's running statistics, no dropout), so the mix is
all the adaptation changes. The first time a client adapts, ``W`` is trained until the
standard deviation of its last ``WINDOW`` epochs' mean losses falls below
``fedala.threshold`` (at most ``fedala.max-epochs`` epochs); afterwards one epoch each time.
A client without a local model (its first message) keeps the global model as it arrived:
the mix would be the same.
"""

from __future__ import annotations

import math
import statistics

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from models.fedala import ADAPTED, adapted_names, weight_key
from strategies.fedala.spec import FedALASettings
from strategies.training import Arrival

WINDOW = 5  # epochs whose mean losses must agree within fedala.threshold (first adaptation)


def sampled(job: Arrival, fraction: float) -> DataLoader:
    """A random ``fraction`` of the train split (at least one example), in batches of
    ``batch-size``, shuffled (from torch's generator, which the caller seeded)."""
    dataset = job.loader.dataset
    count = max(1, math.ceil(fraction * len(dataset)))
    chosen = torch.randperm(len(dataset))[:count].tolist()
    generator = torch.Generator().manual_seed(int(torch.randint(2**31 - 1, ())))
    return DataLoader(Subset(dataset, chosen), batch_size=job.settings.batch_size,
                      shuffle=True, generator=generator)


def converged(losses: list[float], threshold: float) -> bool:
    return len(losses) >= WINDOW and statistics.pstdev(losses[-WINDOW:]) < threshold


def adapt_fedala(job: Arrival[FedALASettings]) -> None:
    model, settings = job.model, job.settings.method_settings
    names = adapted_names(model)
    if not all(name in job.own for name in names):
        return  # no local model yet: the global model as it arrived
    params = dict(model.named_parameters())
    weights = {n: model.get_buffer(weight_key(n)) for n in names}
    local = {n: job.own[n].to(params[n].device, params[n].dtype) for n in names}
    delta = {n: job.received[n].to(params[n].device, params[n].dtype) - local[n]
             for n in names}
    first = float(model.get_buffer(ADAPTED)) == 0.0

    def mix() -> None:
        with torch.no_grad():
            for n in names:
                params[n].copy_(local[n] + delta[n] * weights[n])

    mix()
    if not len(job.loader.dataset):
        return
    loader = sampled(job, settings.data_fraction)
    for p in model.parameters():
        p.requires_grad_(any(p is params[n] for n in names))
    was_training = model.training
    model.eval()
    criterion = nn.CrossEntropyLoss()
    losses: list[float] = []
    try:
        while True:
            total, batches = 0.0, 0
            for x, y in loader:
                x, y = x.to(job.device), y.to(job.device)
                for n in names:
                    params[n].grad = None
                loss = criterion(model(x), y)
                loss.backward()
                with torch.no_grad():
                    for n in names:
                        if params[n].grad is not None:  # None: a tensor the loss skips
                            weights[n].sub_(settings.lr * params[n].grad * delta[n])
                            weights[n].clamp_(0, 1)
                mix()
                total += loss.item()
                batches += 1
            losses.append(total / max(batches, 1))
            if (not first or len(losses) >= settings.max_epochs
                    or converged(losses, settings.threshold)):
                break
    finally:
        for p in model.parameters():
            p.grad = None
            p.requires_grad_(True)
        model.train(was_training)
    model.get_buffer(ADAPTED).fill_(1.0)
