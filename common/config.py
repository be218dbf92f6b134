"""The run configuration (contracts §2): typed, validated, one clear error per bad key.

Flower hands both apps the same flat ``context.run_config`` (``[tool.flwr.app.config]`` plus
``--run-config`` overrides). Keys are declared once, in a ``KeyGroup`` dataclass: each field
names its key, and its type and range come from the declaration; **defaults live only in
``pyproject.toml``** (a key missing from the run config is an error, and a test checks that
every declared key is in ``pyproject.toml`` and every key there is declared).

``RunSettings`` holds the keys every method uses; a method declares its own keys in its own
``KeyGroup`` (e.g. ``strategies/feddecomp/spec.py``), parsed into
``RunSettings.method_settings``.
Which methods, datasets and backbones exist is known only to the layers above; they check those
names (``strategies/registry.py: load_settings``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Self, TypeVar

PARTITIONERS = ("iid", "dirichlet", "pathological", "domain", "natural")
FEATURE_SHIFTS = ("none", "rotate")  # fldata/partition.py: feature_shift
AGGREGATION_RULES = ("mean", "median", "trimmed-mean")
DEVICES_HELP = "auto, cpu, cuda, cuda:N"
TRACKERS = ("tensorboard", "mlflow")  # server_app/tracking.py
DP_MODES = ("", "central", "local")  # docs/privacy.md
# Rounds at the end of a run that are evaluated at any ``evaluate-every``: a comparison's
# figures are read from them (comparison/stats.py: the mean of the last 5, the slope over
# the last 10), so they are the same whatever the cadence.
EVALUATED_LAST_ROUNDS = 10


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or out of range.

    The message is one line naming the key and what is allowed.
    """


# which part of the pool a run partitions: all of it, or one of two disjoint parts (a
# comparison's tuning runs on one, its report runs on the other: fldata.partition.pool_part)
POOL_PARTS = ("", "tuning", "report")
DATA_CACHE_VALUES = ("", "off")  # all the run config may say: where is the site's choice


def check_data_cache(value: str) -> str:
    """The run config's ``data-cache``: ``""`` (the site's own cache) or ``"off"``. Where a
    site writes, and what its cache pruning deletes, is the site's to choose (its node
    config), never the server operator's: a path here is refused with one line."""
    if value not in DATA_CACHE_VALUES:
        raise ConfigError(f"data-cache: {value!r} is refused: the run config takes only '' "
                          "(each site's own cache) or 'off'; a site sets where it keeps its "
                          "data cache with its node config (--node-config "
                          "\"data-cache='/abs/dir'\"), else it lies under its state-dir")
    return value


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the known word closest to ``word`` (case aside), or
    ``""`` when none is close: the end of a one-line error about an unknown name."""
    by_lower = {name.lower(): name for name in known}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.75)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def one_of(key: str, value: str, allowed: Iterable[str]) -> str:
    """Return ``value`` if it is in ``allowed``, else raise a one-line ConfigError."""
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r}; allowed: {', '.join(allowed)}"
                          f"{did_you_mean(value, allowed)}")
    return value


def in_range(key: str, value: float, low: float | None = None, high: float | None = None,
             *, low_open: bool = False) -> float:
    """Return ``value`` if ``low <(=) value <= high``, else raise a one-line ConfigError."""
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        bracket = "(" if low_open else "["
        raise ConfigError(f"{key}: {value} is out of range; allowed: {bracket}{lo}, {hi}]")
    return value


def typed(raw: Mapping[str, Any], key: str, kind: type) -> Any:
    """``raw[key]`` checked to be of ``kind`` (an int is accepted for a float, an integral
    float for an int; a bool is never a number); missing keys and NaN/inf are errors."""
    if key not in raw:
        raise ConfigError(f"{key}: missing from the run config (its default is in "
                          "pyproject.toml's [tool.flwr.app.config])")
    value = raw[key]
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: {value} is not a finite number")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


def key(name: str, *, low: float | None = None, high: float | None = None,
        low_open: bool = False, choices: Iterable[str] | None = None) -> Any:
    """Declare a ``KeyGroup`` field: the run-config key it reads and its allowed values (the
    field's annotation gives the type). No default: defaults live in ``pyproject.toml``."""
    return field(metadata={"key": name, "low": low, "high": high, "low_open": low_open,
                           "choices": tuple(choices) if choices is not None else None})


_KINDS = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass(frozen=True)
class KeyGroup:
    """A set of run-config keys parsed into typed fields (see ``key``)."""

    prefix: ClassVar[str] = ""  # documentation only: the keys' common prefix

    @classmethod
    def keys(cls) -> list[str]:
        return [f.metadata["key"] for f in dataclasses.fields(cls) if "key" in f.metadata]

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Self:
        values = {}
        for spec in dataclasses.fields(cls):
            meta = spec.metadata
            if "key" not in meta:
                continue
            value = typed(raw, meta["key"], _KINDS[str(spec.type)])
            if meta["choices"] is not None:
                one_of(meta["key"], value, meta["choices"])
            if meta["low"] is not None or meta["high"] is not None:
                in_range(meta["key"], value, meta["low"], meta["high"],
                         low_open=meta["low_open"])
            values[spec.name] = value
        return cls(**values)


MethodSettingsT = TypeVar("MethodSettingsT", bound=KeyGroup | None)
"""A method's own settings type (its ``KeyGroup``; ``None`` for a method without keys): what
``RunSettings``, ``LocalTraining``, ``WireSpec``, the strategy and the ``Method`` record are
generic in, so that a method's rules are typed against its own keys."""
# ``RunSettings.with_method`` turns a ``RunSettings[A]`` into a ``RunSettings[B]``: it needs a
# type variable of its own, not the class's.
SettingsT = TypeVar("SettingsT", bound=KeyGroup | None)


def node_owners(text: str) -> dict[str, set[str]]:
    """``identity.node-owners``: comma-separated ``<registered node name>=<client id>`` pairs
    (a name may appear more than once) -> name -> the client ids that node may speak for."""
    owners: dict[str, set[str]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, client_id = (p.strip() for p in item.partition("="))
        if not sep or not name or not client_id:
            raise ConfigError(f"identity.node-owners: {item!r} is not <node name>=<client id>")
        owners.setdefault(name, set()).add(client_id)
    return owners


def leaves_shared_epochs(name: str, epochs: int, local_epochs: int) -> None:
    """A method's personal phase (``fedrep.head-epochs``, ``feddecomp.lora-epochs``) leaves
    at least one of the ``local-epochs`` to the shared part: otherwise the shared part is
    never trained and the federation learns nothing, without a word."""
    if epochs < 0 or (epochs >= local_epochs and local_epochs > 0) or (
            local_epochs == 0 and epochs != 0):
        raise ConfigError(f"{name}: {epochs} leaves no epoch of local-epochs={local_epochs} "
                          f"to the shared part; allowed: [0, {max(local_epochs - 1, 0)}]")


def check_privacy_bound(settings: RunSettings) -> None:
    """The general keys that would break differential privacy's sensitivity bound, refused
    in one line naming them (a method's own keys: its ``Method.check``)."""
    mode = settings.dp_mode
    if mode == "central" and settings.aggregation != "mean":
        raise ConfigError(f"aggregation.rule={settings.aggregation!r} with dp.mode='central': "
                          "the noise is calibrated to a sum of clipped updates; use "
                          "aggregation.rule='mean' (or dp.mode='local')")
    if mode == "central" and settings.clip_norm > 0:
        raise ConfigError("aggregation.clip-norm with dp.mode='central': dp.clip-norm "
                          "clips the updates; set aggregation.clip-norm=0")
    if mode == "local" and settings.dp_adaptive_clipping:
        raise ConfigError("dp.adaptive-clipping with dp.mode='local': each client's "
                          "clipped-or-not bit would leave it without noise; use "
                          "dp.mode='central' or a fixed dp.clip-norm")


@dataclass(frozen=True)
class RunSettings(KeyGroup, Generic[MethodSettingsT]):
    """The keys every method uses, shared by the ServerApp and the ClientApp;
    ``method_settings`` holds the method's own ``KeyGroup`` (``None`` for a method without
    keys)."""

    method: str = key("method")
    dataset: str = key("dataset")
    data_root: str = key("data-root")
    data_cache: str = key("data-cache")
    partitioner: str = key("partitioner", choices=PARTITIONERS)
    partition_column: str = key("partition-column")
    dirichlet_alpha: float = key("dirichlet-alpha", low=0, low_open=True)
    min_partition_size: int = key("min-partition-size", low=0)
    classes_per_client: int = key("classes-per-client", low=1)
    domain_groups: int = key("domain-groups", low=1)
    permute_labels: bool = key("permute-labels")
    feature_shift: str = key("feature-shift", choices=FEATURE_SHIFTS)
    feature_shift_groups: int = key("feature-shift-groups", low=1, high=4)
    test_fraction: float = key("test-fraction", low=0, high=1, low_open=True)
    validation_fraction: float = key("validation-fraction", low=0, high=0.9)
    pool_part: str = key("pool-part", choices=POOL_PARTS)
    tuning_share: float = key("tuning-share", low=0, high=0.9, low_open=True)
    num_classes: int = key("num-classes", low=0)
    input_shape: str = key("input-shape")
    image_column: str = key("image-column")
    label_column: str = key("label-column")
    model: str = key("model")
    mlp_hidden: int = key("mlp-hidden", low=1)
    num_server_rounds: int = key("num-server-rounds", low=1)
    fraction_train: float = key("fraction-train", low=0, high=1, low_open=True)
    fraction_evaluate: float = key("fraction-evaluate", low=0, high=1)
    fused_evaluation: bool = key("fused-evaluation")
    evaluate_every: int = key("evaluate-every", low=1)
    min_nodes: int = key("min-nodes", low=1)
    local_epochs: int = key("local-epochs", low=0)
    batch_size: int = key("batch-size", low=1)
    lr: float = key("lr", low=0, low_open=True)
    momentum: float = key("momentum", low=0, high=1)
    weight_decay: float = key("weight-decay", low=0)
    seed: int = key("seed")
    device: str = key("device")
    output_dir: str = key("output-dir")
    round_timeout: float = key("round-timeout", low=0, low_open=True)
    max_in_flight: int = key("max-in-flight", low=1)
    resume_from: str = key("resume-from")
    plot: bool = key("plot")
    tracking: str = key("tracking")
    # trust boundaries (docs/security.md)
    node_owners: str = key("identity.node-owners")
    require_registered: bool = key("identity.require-registered")
    max_clients: int = key("identity.max-clients", low=1)
    expire_rounds: int = key("identity.expire-rounds", low=0)
    aggregation: str = key("aggregation.rule", choices=AGGREGATION_RULES)
    trim_fraction: float = key("aggregation.trim-fraction", low=0, high=0.45)
    clip_norm: float = key("aggregation.clip-norm", low=0)
    max_num_examples: int = key("aggregation.max-num-examples", low=1)
    # differential privacy of what leaves a client (docs/privacy.md)
    dp_mode: str = key("dp.mode", choices=DP_MODES)
    dp_clip_norm: float = key("dp.clip-norm", low=0, low_open=True)
    dp_noise_multiplier: float = key("dp.noise-multiplier", low=0, low_open=True)
    # above 1e-3 a delta is a weak guarantee for any federation (docs/privacy.md)
    dp_delta: float = key("dp.delta", low=0, high=1e-3)
    dp_target_epsilon: float = key("dp.target-epsilon", low=0)
    dp_adaptive_clipping: bool = key("dp.adaptive-clipping")
    dp_target_quantile: float = key("dp.target-quantile", low=0, high=1)
    dp_clip_lr: float = key("dp.clip-lr", low=0, low_open=True)
    dp_clipped_count_stddev: float = key("dp.clipped-count-stddev", low=0)
    method_settings: MethodSettingsT = field(default=None, compare=False)  # type: ignore[assignment]
    raw: dict[str, Any] = field(repr=False, default_factory=dict, compare=False)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunSettings:
        """The general keys, parsed and checked; the method's own keys are not (see
        ``strategies/registry.py: load_settings`` for the whole run config)."""
        raw = dict(run_config)
        settings = dataclasses.replace(cls.parse(raw), raw=raw)
        node_owners(settings.node_owners)
        check_data_cache(settings.data_cache)
        if settings.partitioner == "natural" and not settings.partition_column:
            raise ConfigError("partition-column: the natural partitioner needs the column "
                              "whose distinct values are the clients, e.g. "
                              "partition-column='writer'")
        device = settings.device
        if not (device in ("auto", "cpu", "cuda") or
                (device.startswith("cuda:") and device[5:].isdigit())):
            raise ConfigError(f"device: unknown value {device!r}; allowed: {DEVICES_HELP}")
        settings.trackers()
        check_privacy_bound(settings)
        every, expire = settings.evaluate_every, settings.expire_rounds
        if every > 1 and expire and every >= expire:
            # with fused evaluation round r's evaluation is heard in round r + 1's exchange:
            # k + 1 rounds apart at most, past expire-rounds unless k is below it
            raise ConfigError(f"evaluate-every={every} with identity.expire-rounds={expire}: "
                              "a client that does not train is heard from at its evaluations "
                              "only and would expire between them; lower evaluate-every")
        return settings

    def trackers(self) -> list[str]:
        """``tracking``: "", "tensorboard", "mlflow" or both, comma-separated."""
        names = [n.strip() for n in self.tracking.split(",") if n.strip()]
        for name in names:
            one_of("tracking", name, TRACKERS)
        return names

    def with_method(self, method_settings: SettingsT) -> RunSettings[SettingsT]:
        return dataclasses.replace(self, method_settings=method_settings)  # type: ignore[return-value,arg-type]
