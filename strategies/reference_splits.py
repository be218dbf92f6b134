"""The benchmark seam for FedFac: reference splits (``fedfac.split``), kept out of its home.

FedFac's split claim (the estimated split beats a random one of the same size, eq. 8) needs
splits to compare with: ``true``, the synthetic generator's own split of the first analysed
layer's units (``dataset = "synthetic-fedfac"`` only), and ``random``, as many shared
elements as FedFac estimated, drawn at random (seeded by the run's seed and the round).
``estimate`` (the default) is FedFac itself: the estimate goes through unchanged. The
key and its check are declared with the other FedFac keys (``spec.py``). On the
synthetic data, the report also says how much of the true split the estimate found.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.config import RunSettings
from fldata import synthetic_generator
from strategies.fedfac.spec import FedFacSettings

SYNTHETIC = "synthetic-fedfac"


class ReferenceSplit:
    def __init__(self, settings: RunSettings[FedFacSettings], first_layer: str,
                 num_units: int) -> None:
        self.kind = settings.method_settings.split
        self.seed = settings.seed
        self.first_layer = first_layer
        self.true_shared: np.ndarray | None = None
        if settings.dataset == SYNTHETIC:
            true = synthetic_generator(settings).true_shared_units()
            if len(true) == num_units:  # the generator's units are the layer's elements
                self.true_shared = true

    def apply(self, server_round: int, layer: str, estimated: np.ndarray) -> np.ndarray:
        """The split to use for ``layer`` in place of FedFac's ``estimated`` one."""
        if self.kind == "true" and layer == self.first_layer:
            return self.true_shared.copy()
        if self.kind == "random":
            rng = np.random.default_rng([self.seed, server_round])
            mask = np.zeros_like(estimated)
            mask[rng.choice(len(mask), int(estimated.sum()), replace=False)] = True
            return mask
        return estimated

    def overlap(self, layer: str, mask: np.ndarray) -> dict[str, Any]:
        """``true_overlap``: the share of the true shared units in ``mask`` (synthetic data,
        first analysed layer), for the per-round report."""
        if self.true_shared is None or layer != self.first_layer:
            return {}
        return {"true_overlap": float((mask & self.true_shared).sum()
                                      / max(self.true_shared.sum(), 1))}
