"""FedDecomp's server rule: the mean of the clients' ``sigma`` (and of every other shared key).

``feddecomp.weighting = "uniform"`` (the paper's aggregation): every replying client has
weight ``1/N``. ``"examples"``: weighted by the clients' training examples (FedAvg's rule).
Either goes through the run's ``aggregation.*`` rule (a robust rule replaces the mean). The
same aggregate goes to every client, which adds its own ``tau``.
"""

from __future__ import annotations

from flwr.app import ArrayRecord

from common.protocol import ClientReply
from strategies.engine import MethodRule
from strategies.feddecomp.spec import FedDecompSettings


class FedDecompRule(MethodRule[FedDecompSettings]):
    def merge_updates(self, server_round: int, replies: list[ClientReply],
                      arrays: ArrayRecord) -> ArrayRecord:
        uniform = self.settings.method_settings.weighting == "uniform"
        return self.run.aggregate(replies, list(arrays.keys()), arrays, uniform)
