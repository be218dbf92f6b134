"""The message protocol between the ServerApp and the ClientApp (contracts §5).

Both sides build and read messages with these names only:

- downlink (``train``/``evaluate``): ``arrays`` (ArrayRecord: what the method sends this
  client) and ``config`` (ConfigRecord: ``server-round`` and run-lineage entries);
  ``query``: ``config`` with an ``action`` (``identify`` or a method's action), maybe ``arrays``;
- uplink: ``arrays`` (only what the method shares), ``metrics`` (MetricRecord, always
  ``num-examples``) and ``client`` (ConfigRecord: ``client-id``, ``partition-id``,
  ``num-partitions`` and the method's extra entries; a ConfigRecord so that nothing in it is
  averaged as a metric).

``parse_reply`` is the one reading of a reply's envelope; what the arrays must be is the
method's wire spec (``strategies/wire.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

ARRAYS, CONFIG, METRICS, CLIENT = "arrays", "config", "metrics", "client"
NUM_EXAMPLES = "num-examples"
CLIENT_ID, PARTITION_ID, NUM_PARTITIONS = "client-id", "partition-id", "num-partitions"
SERVER_ROUND, ACTION, IDENTIFY = "server-round", "action", "identify"
TRAIN_METRICS = ("train-loss",)
EVALUATE_METRICS = ("accuracy", "loss")

ArraySpec = dict[str, tuple[tuple[int, ...], str]]
"""key -> (shape, dtype) of every array a message carries."""


def spec_of(arrays: ArrayRecord) -> ArraySpec:
    """key -> (shape, dtype) of every array in ``arrays``."""
    return {k: (tuple(a.shape), str(a.dtype)) for k, a in arrays.items()}


def identity_record(client_id: str, partition_id: int, num_partitions: int,
                    extra: Mapping[str, Any] | None = None) -> ConfigRecord:
    """The ``client`` record every reply carries."""
    return ConfigRecord({CLIENT_ID: client_id, PARTITION_ID: partition_id,
                         NUM_PARTITIONS: num_partitions, **(extra or {})})


def client_order(client_id: str) -> tuple[int, str]:
    """Sort key of client ids: numbers in numeric order, then names."""
    return (int(client_id), "") if client_id.isdigit() else (1 << 30, client_id)


def claimed_client_id(reply: Message) -> str | None:
    """The client id a reply says it comes from (None if it has none)."""
    if reply.has_error() or CLIENT not in reply.content.config_records:
        return None
    value = reply.content.config_records[CLIENT].get(CLIENT_ID)
    return value if isinstance(value, str) else None


class ReplyError(ValueError):
    """Why a reply was dropped."""


@dataclass
class ClientReply:
    """A reply whose envelope was checked: who sent it and what it carries."""

    node_id: int
    client_id: str
    arrays: ArrayRecord
    metrics: MetricRecord
    info: ConfigRecord

    @property
    def num_examples(self) -> int:
        return int(self.metrics[NUM_EXAMPLES])

    @property
    def content(self) -> RecordDict:
        return RecordDict({ARRAYS: self.arrays, METRICS: self.metrics})


def parse_reply(node_id: int, reply: Message, metric_keys: tuple[str, ...]) -> ClientReply:
    """Check a reply's envelope: not an error, a string client id, finite metrics including
    ``num-examples`` (a positive int) and ``metric_keys``. Raises ``ReplyError``."""
    if reply.has_error():
        raise ReplyError(f"error reply (code {reply.error.code}): {reply.error.reason}")
    content = reply.content
    info = content.config_records.get(CLIENT)
    client_id = claimed_client_id(reply)
    if info is None or client_id is None:
        raise ReplyError(f"no ConfigRecord {CLIENT!r} with a string {CLIENT_ID!r}")
    metrics = content.metric_records.get(METRICS)
    if metrics is None:
        raise ReplyError(f"no MetricRecord {METRICS!r}")
    missing = [k for k in (NUM_EXAMPLES, *metric_keys) if k not in metrics]
    if missing:
        raise ReplyError(f"metrics lack {missing}")
    for name, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if not all(math.isfinite(float(v)) for v in values):
            raise ReplyError(f"metric {name!r} is not finite")
    if not (isinstance(metrics[NUM_EXAMPLES], int) and metrics[NUM_EXAMPLES] > 0):
        raise ReplyError(f"{NUM_EXAMPLES} must be a positive int")
    return ClientReply(node_id, client_id, content.array_records.get(ARRAYS, ArrayRecord()),
                       metrics, info)


def check_arrays(arrays: ArrayRecord, expected: ArraySpec) -> None:
    """``arrays`` carries exactly ``expected``: same keys, shapes and dtypes, finite values."""
    got = set(arrays.keys())
    if got != set(expected):
        unknown, missing = sorted(got - set(expected)), sorted(set(expected) - got)
        raise ReplyError(f"array keys differ: unknown {unknown[:5]}, missing {missing[:5]}")
    for name, (shape, dtype) in expected.items():
        array = arrays[name]
        if tuple(array.shape) != shape:
            raise ReplyError(f"{name!r} has shape {tuple(array.shape)}, expected {shape}")
        if str(array.dtype) != dtype:
            raise ReplyError(f"{name!r} has dtype {array.dtype}, expected {dtype}")
        values = array.numpy()
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            raise ReplyError(f"{name!r} has non-finite values")
