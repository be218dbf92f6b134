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

A handler that fails answers with an error reply whose reason is one line,
``<exception type>: <message>`` (``error_reason``); ``shared_failure`` tells a failure every
client shares (the run cannot go on) from some clients failing (their replies are dropped).
"""

from __future__ import annotations

import io
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

ARRAYS, CONFIG, METRICS, CLIENT = "arrays", "config", "metrics", "client"
NUM_EXAMPLES = "num-examples"
CLIENT_ID, PARTITION_ID, NUM_PARTITIONS = "client-id", "partition-id", "num-partitions"
SERVER_ROUND, ACTION, IDENTIFY = "server-round", "action", "identify"
TRAIN_METRICS = ("train-loss",)
EVALUATE_METRICS = ("accuracy", "loss")
# under dp.mode = "local" a reply carries no exact data-dependent value (strategies/privacy.py:
# released_metrics): no losses, no timings; accuracies noised, example counts fixed at 1
LOCAL_DP_TRAIN_METRICS: tuple[str, ...] = ()
LOCAL_DP_EVALUATE_METRICS = ("accuracy",)
# a site's opt-in to exact evaluation under local DP (its node config key; the flag its
# replies carry: their accuracies are exact and not accounted)
EXACT_EVALUATION = "dp-exact-evaluation"


def train_metric_keys(dp_mode: str) -> tuple[str, ...]:
    """The metrics a train reply must carry under ``dp_mode`` (besides ``num-examples``)."""
    return LOCAL_DP_TRAIN_METRICS if dp_mode == "local" else TRAIN_METRICS


def evaluate_metric_keys(dp_mode: str) -> tuple[str, ...]:
    """The metrics an evaluate reply must carry under ``dp_mode``."""
    return LOCAL_DP_EVALUATE_METRICS if dp_mode == "local" else EVALUATE_METRICS
# a client's balanced accuracy on its own test split (the mean over the classes present in it
# of the share of that class's examples classified right: ``strategies/training.py:
# accuracy_scores``); optional in a reply like ``cpu-seconds``, range-checked when present
TASK_ACCURACY = "task-accuracy"
# differential privacy (strategies/privacy.py): a train message's clip norm, and a train
# reply's metric (central DP only) saying whether its update was clipped
DP_CLIP_NORM = "dp-clip-norm"
DP_CLIPPED = "dp-clipped"

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


CLIENT_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""What a client id may be: ASCII letters, digits, ``.``, ``_``, ``-``, at most 64 characters,
starting with a letter or digit (it becomes a file name on the client: ``<id>.pt``)."""

# the evaluation a train reply carries with fused evaluation (``strategies/engine/
# evaluation.py``)
EVAL_ACCURACY, EVAL_LOSS, EVAL_EXAMPLES = "eval-accuracy", "eval-loss", "eval-num-examples"
EVAL_TASK_ACCURACY = "eval-task-accuracy"
EVAL_CPU = "eval-cpu-seconds"  # CPU time of the evaluation (``cpu-seconds``: the training)
EVALUATE_FIRST = "evaluate-first"

METRIC_RANGES: dict[str, tuple[float, float]] = {
    "accuracy": (0.0, 1.0), "loss": (0.0, math.inf), "train-loss": (0.0, math.inf),
    "cpu-seconds": (0.0, math.inf), EVAL_ACCURACY: (0.0, 1.0), EVAL_LOSS: (0.0, math.inf),
    EVAL_CPU: (0.0, math.inf), TASK_ACCURACY: (0.0, 1.0), EVAL_TASK_ACCURACY: (0.0, 1.0),
    DP_CLIPPED: (0.0, 1.0), EXACT_EVALUATION: (1.0, 1.0), "mu-density": (0.0, 1.0)}
"""Allowed ranges of the metrics the server reads; any other metric must be a finite number."""


def is_client_id(value: object) -> bool:
    return isinstance(value, str) and CLIENT_ID_PATTERN.fullmatch(value) is not None


def shown(value: object, limit: int = 80) -> str:
    """``value`` as it may appear in a log line or results.json (a valid client id as it
    is; anything else quoted, escaped and cut)."""
    if is_client_id(value):
        return str(value)
    text = ascii(value)
    return text if len(text) <= limit else text[:limit] + "..."


def client_order(client_id: str) -> tuple[int, str]:
    """Sort key of client ids: numbers (ASCII digits) in numeric order, then names."""
    if client_id.isascii() and client_id.isdigit():
        return (int(client_id), "")
    return (1 << 30, client_id)


def claimed_client_id(reply: Message) -> str | None:
    """The client id a reply says it comes from (None if it has none)."""
    if reply.has_error() or CLIENT not in reply.content.config_records:
        return None
    value = reply.content.config_records[CLIENT].get(CLIENT_ID)
    return value if isinstance(value, str) else None


class ReplyError(ValueError):
    """Why a reply was dropped."""


# Error codes that say the ClientApp itself failed (it could not be loaded, or a handler
# raised): the same message would fail the same way again. The others (a node unavailable, a
# message lost) tell of the transport, and a later round may go through.
HANDLER_FAILED = (ErrorCode.LOAD_CLIENT_APP_EXCEPTION, ErrorCode.CLIENT_APP_RAISED_EXCEPTION)


def error_reason(error: BaseException, limit: int = 300) -> str:
    """The one-line reason of a failed handler's error reply: ``<type>: <message>``."""
    message = " ".join(str(error).split())
    message = message if len(message) <= limit else message[:limit] + "..."
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def shared_failure(replies: Iterable[Message]) -> str | None:
    """The reason every one of ``replies`` failed, when all of them are error replies of a
    failed ClientApp (``HANDLER_FAILED``) of one kind (the exception type their reasons
    begin with); None when there is no reply, one succeeded, one failed in transport, or
    they failed in different ways. The reason returned is the most frequent one."""
    reasons: Counter[str] = Counter()
    for reply in replies:
        if not reply.has_error() or reply.error.code not in HANDLER_FAILED:
            return None
        reasons[str(reply.error.reason)] += 1
    if len({reason.split(":", 1)[0] for reason in reasons}) != 1:
        return None
    return reasons.most_common(1)[0][0]


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


# What every reason a reply is dropped for a value that is not finite (a metric, an array)
# says: how a comparison tells a run whose clients diverged from one that lost them otherwise.
NOT_FINITE = "not finite"
# What the reason a reply is dropped for not arriving within the round's wait says: how a
# comparison tells a run the machine stalled in from one whose method lost the client
NO_REPLY = "no reply within round-timeout"


def _finite_number(name: str, value: object) -> float:
    """A metric value: an int or float (not a bool, not a list), finite, in its range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ReplyError(f"metric {name!r} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ReplyError(f"metric {name!r} is {NOT_FINITE}")
    low, high = METRIC_RANGES.get(name, (-math.inf, math.inf))
    if not low <= value <= high:
        raise ReplyError(f"metric {name!r} = {value} is outside [{low}, {high}]")
    return float(value)


def _check_identity(info: ConfigRecord) -> str:
    """The ``client`` record's own entries: a safe client id, integer partition entries."""
    client_id = info.get(CLIENT_ID)
    if not isinstance(client_id, str):
        raise ReplyError(f"no ConfigRecord {CLIENT!r} with a string {CLIENT_ID!r}")
    if not is_client_id(client_id):
        raise ReplyError(f"{CLIENT_ID} {shown(client_id)} is not a safe id "
                         f"(pattern {CLIENT_ID_PATTERN.pattern})")
    partition, partitions = info.get(PARTITION_ID), info.get(NUM_PARTITIONS)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (partition, partitions)):
        raise ReplyError(f"{PARTITION_ID} and {NUM_PARTITIONS} must be ints")
    if not 0 <= partition < partitions:
        raise ReplyError(f"{PARTITION_ID} {partition} is not in [0, {NUM_PARTITIONS}="
                         f"{partitions})")
    return client_id


def require_metrics(metrics: MetricRecord, keys: tuple[str, ...]) -> None:
    """Raise ``ReplyError`` naming the ``keys`` that ``metrics`` lacks (their values are
    checked with every metric, ``parse_reply``)."""
    missing = [k for k in keys if k not in metrics]
    if missing:
        raise ReplyError(f"metrics lack {missing}")


def parse_reply(node_id: int, reply: Message, metric_keys: tuple[str, ...] | None,
                max_examples: int | None = None) -> ClientReply:
    """Check a reply's envelope: not an error; a ``client`` record with a safe client id and
    integer ``partition-id < num-partitions``; metrics that are finite numbers in range
    (``METRIC_RANGES``), including ``num-examples`` (an int in ``[1, max_examples]``) and
    ``metric_keys``. ``metric_keys`` None: a query reply, whose metrics are optional (checked
    the same way when present). Raises ``ReplyError``."""
    if reply.has_error():
        raise ReplyError(f"error reply (code {reply.error.code}): {shown(reply.error.reason, 200)}")
    content = reply.content
    info = content.config_records.get(CLIENT)
    if info is None:
        raise ReplyError(f"no ConfigRecord {CLIENT!r} with a string {CLIENT_ID!r}")
    client_id = _check_identity(info)
    metrics = content.metric_records.get(METRICS)
    if metrics is None and metric_keys is not None:
        raise ReplyError(f"no MetricRecord {METRICS!r}")
    metrics = metrics if metrics is not None else MetricRecord()
    if metric_keys is not None or len(metrics) > 0:
        require_metrics(metrics, (NUM_EXAMPLES, *(metric_keys or ())))
    for name, value in metrics.items():
        _finite_number(name, value)
    if NUM_EXAMPLES in metrics:
        examples = metrics[NUM_EXAMPLES]
        if not (isinstance(examples, int) and examples > 0):
            raise ReplyError(f"{NUM_EXAMPLES} must be a positive int")
        if max_examples is not None and examples > max_examples:
            raise ReplyError(f"{NUM_EXAMPLES} {examples} exceeds "
                             f"aggregation.max-num-examples={max_examples}")
    return ClientReply(node_id, client_id, content.array_records.get(ARRAYS, ArrayRecord()),
                       metrics, info)


def decode_array(name: str, array: Array, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The array's values, checked to be a NumPy array of exactly ``shape`` and ``dtype``.

    The declared metadata, the size of the payload and the ``.npy`` header inside it are
    checked before anything is decoded (a payload may declare any shape: nothing is
    allocated for it), then the decoded values themselves."""
    if array.stype != "numpy.ndarray":
        raise ReplyError(f"{name!r} is not a NumPy array (stype {shown(array.stype)})")
    if tuple(array.shape) != shape:
        raise ReplyError(f"{name!r} has shape {shown(tuple(array.shape))}, expected {shape}")
    if str(array.dtype) != dtype:
        raise ReplyError(f"{name!r} has dtype {shown(array.dtype)}, expected {dtype}")
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if not isinstance(array.data, bytes) or len(array.data) > nbytes + 4096:
        raise ReplyError(f"{name!r} carries {len(array.data)} bytes for {nbytes} bytes of data")
    stream = io.BytesIO(array.data)
    try:
        version = np.lib.format.read_magic(stream)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}[version]
        header = read_header(stream)
    except Exception as error:
        raise ReplyError(f"{name!r} does not decode: {shown(str(error), 120)}") from None
    real_shape, _, real_dtype = header
    if tuple(real_shape) != shape or str(real_dtype) != dtype:
        raise ReplyError(f"{name!r} holds {real_dtype} data of shape {shown(tuple(real_shape))}"
                         f", declared {dtype} {shape}")
    try:
        values = np.load(io.BytesIO(array.data), allow_pickle=False)
    except Exception as error:
        raise ReplyError(f"{name!r} does not decode: {shown(str(error), 120)}") from None
    if not isinstance(values, np.ndarray) or values.shape != shape or str(values.dtype) != dtype:
        raise ReplyError(f"{name!r} does not decode to {dtype} {shape}")
    return values


def check_arrays(arrays: ArrayRecord, expected: ArraySpec) -> ArrayRecord:
    """``arrays`` carries exactly ``expected``: same keys, NumPy arrays of exactly these shapes
    and dtypes (declared and decoded, ``decode_array``), finite values. Returns the decoded
    values as a fresh ``ArrayRecord`` (what the server goes on with)."""
    got = set(arrays.keys())
    if got != set(expected):
        unknown, missing = sorted(got - set(expected)), sorted(set(expected) - got)
        raise ReplyError(f"array keys differ: unknown {shown(unknown[:5], 200)}, "
                         f"missing {missing[:5]}")
    checked = {}
    for name, (shape, dtype) in expected.items():
        values = decode_array(name, arrays[name], shape, dtype)
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            raise ReplyError(f"{name!r} has values that are {NOT_FINITE}")
        checked[name] = Array(values)
    return ArrayRecord(checked)
