"""The seeds a client derives from the run's ``seed``: one per (round, client, stream), so that
two clients, two rounds or two streams never share a random sequence, and a run repeats
exactly with its seed (in both evaluation protocols, and after a resume)."""

from __future__ import annotations

from enum import Enum


class Stream(Enum):
    """What a derived seed drives: (factor of the run's seed, factor of the round, offset).
    The factors are primes, so that (seed, round, partition) triples do not collide."""

    TRAIN = (7919, 31, 0)            # torch's global generator before local training
    FINE_TUNE = (7919, 31, 104_729)  # the same before FedAvg-FT's fine-tuning copy
    ADAPT = (7919, 31, 209_458)      # the same before a method's ``adapt`` (FedALA's sample)
    SHUFFLE = (100_003, 1009, 0)     # the order of a round's training batches


def derived_seed(seed: int, server_round: int, partition_id: int, stream: Stream) -> int:
    """The seed of ``stream`` for client ``partition_id`` in round ``server_round``."""
    per_seed, per_round, offset = stream.value
    return seed * per_seed + server_round * per_round + partition_id + offset
