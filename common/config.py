"""The run configuration (contracts §2): typed, validated, one clear error per bad key.

Flower hands both apps the same flat ``context.run_config`` (``[tool.flwr.app.config]`` plus
``--run-config`` overrides). ``RunSettings.from_run_config`` turns it into typed fields for the
keys every method uses; method keys (``"fedprox.mu"``, ``"feddecomp.rank-conv"``...) stay in
``raw`` and are read with ``setting()``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PARTITIONERS = ("iid", "dirichlet", "pathological", "domain")
DEVICES_HELP = "auto, cpu, cuda, cuda:N"


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or out of range.

    The message is one line naming the key and what is allowed.
    """


def one_of(key: str, value: str, allowed: Iterable[str]) -> str:
    """Return ``value`` if it is in ``allowed``, else raise a one-line ConfigError."""
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}: unknown value {value!r}; allowed: {', '.join(allowed)}")
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


def _typed(raw: Mapping[str, Any], key: str, kind: type, default: Any = None) -> Any:
    if key not in raw:
        if default is None:
            raise ConfigError(f"{key}: missing from the run config")
        return default
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    return value


@dataclass(frozen=True)
class RunSettings:
    """The validated run configuration shared by the ServerApp and the ClientApp."""

    method: str
    dataset: str
    partitioner: str
    dirichlet_alpha: float
    classes_per_client: int
    domain_groups: int
    permute_labels: bool
    test_fraction: float
    model: str
    mlp_hidden: int
    num_server_rounds: int
    fraction_train: float
    fraction_evaluate: float
    min_nodes: int
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    seed: int
    device: str
    output_dir: str
    round_timeout: float
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    def setting(self, key: str, kind: type = float, default: Any = None) -> Any:
        """A method key such as ``"fedprox.mu"``, type-checked (missing: ``default``, or an
        error if there is none)."""
        return _typed(self.raw, key, kind, default)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunSettings:
        """Parse and validate; unknown method/dataset/backbone raise ConfigError."""
        # Imported here: the registries import torch models and strategies, and this module
        # must stay importable on its own (e.g. by the data layer).
        from fldata import DATASETS, is_local_path
        from models import BACKBONES
        from strategies.registry import REGISTRY

        raw = dict(run_config)

        def get(key: str, kind: type, default: Any = None) -> Any:
            return _typed(raw, key, kind, default)

        method = one_of("method", get("method", str, "fedavg"), REGISTRY)
        dataset = get("dataset", str, "digits")
        if not is_local_path(dataset):
            one_of("dataset", dataset, [*DATASETS, "<a local path>"])
        model = get("model", str, "")
        if model:
            one_of("model", model, BACKBONES)
        device = get("device", str, "auto")
        if not (device in ("auto", "cpu", "cuda") or
                (device.startswith("cuda:") and device[5:].isdigit())):
            raise ConfigError(f"device: unknown value {device!r}; allowed: {DEVICES_HELP}")
        settings = cls(
            method=method,
            dataset=dataset,
            partitioner=one_of("partitioner", get("partitioner", str, "dirichlet"), PARTITIONERS),
            dirichlet_alpha=in_range("dirichlet-alpha", get("dirichlet-alpha", float, 0.5), 0,
                                     low_open=True),
            classes_per_client=int(in_range("classes-per-client",
                                            get("classes-per-client", int, 2), 1)),
            domain_groups=int(in_range("domain-groups", get("domain-groups", int, 2), 1)),
            permute_labels=get("permute-labels", bool, False),
            test_fraction=in_range("test-fraction", get("test-fraction", float, 0.2), 0, 1,
                                   low_open=True),
            model=model,
            mlp_hidden=int(in_range("mlp-hidden", get("mlp-hidden", int, 200), 1)),
            num_server_rounds=int(in_range("num-server-rounds",
                                           get("num-server-rounds", int, 3), 1)),
            fraction_train=in_range("fraction-train", get("fraction-train", float, 1.0), 0, 1,
                                    low_open=True),
            fraction_evaluate=in_range("fraction-evaluate",
                                       get("fraction-evaluate", float, 1.0), 0, 1),
            min_nodes=int(in_range("min-nodes", get("min-nodes", int, 2), 1)),
            local_epochs=int(in_range("local-epochs", get("local-epochs", int, 1), 0)),
            batch_size=int(in_range("batch-size", get("batch-size", int, 32), 1)),
            lr=in_range("lr", get("lr", float, 0.05), 0, low_open=True),
            momentum=in_range("momentum", get("momentum", float, 0.9), 0, 1),
            weight_decay=in_range("weight-decay", get("weight-decay", float, 0.0), 0),
            seed=get("seed", int, 42),
            device=device,
            output_dir=get("output-dir", str, ""),
            round_timeout=in_range("round-timeout", get("round-timeout", float, 600.0), 0,
                                   low_open=True),
            raw=raw,
        )
        REGISTRY[method].validate(settings)
        return settings
