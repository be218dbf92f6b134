"""FedDecomp's server rule: the mean of the clients' ``sigma`` (and of every other shared key).

``feddecomp.weighting = "uniform"`` (the paper's aggregation): every replying client has
weight ``1/N``. ``"examples"``: weighted by the clients' training examples (FedAvg's rule).
The same aggregate goes to every client, which adds its own ``tau``.
"""

from __future__ import annotations

from flwr.app import ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from common.protocol import ARRAYS, METRICS, ClientReply
from strategies.personalized import PersonalizedStrategy

UNIT = "unit-weight"


class FedDecompStrategy(PersonalizedStrategy):
    def aggregate_shared(self, server_round: int, replies: list[ClientReply],
                         arrays: ArrayRecord) -> ArrayRecord:
        if self.settings.method_settings.weighting == "examples":
            return super().aggregate_shared(server_round, replies, arrays)
        return aggregate_arrayrecords([RecordDict({ARRAYS: r.arrays,
                                                   METRICS: MetricRecord({UNIT: 1})})
                                       for r in replies], UNIT)
