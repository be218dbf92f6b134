"""The run config fails at start with one line naming the key and the allowed values."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from strategies.registry import load_settings
from tests.conftest import app_config


def defaults() -> dict:
    return app_config()


def test_pyproject_defaults_are_valid_and_hold_every_design_key():
    config = defaults()
    load_settings(config)
    design_keys = {"method", "dataset", "partitioner", "dirichlet-alpha", "classes-per-client",
                   "permute-labels", "test-fraction", "model", "num-server-rounds",
                   "fraction-train", "fraction-evaluate", "local-epochs", "batch-size", "lr",
                   "seed", "device", "output-dir", "fedfac.layers", "fedfac.mode",
                   "fedfac.kappa", "fedfac.tau-quantile", "pfedc.tasks", "pfedc.mgda",
                   "factorized-fl.tau", "factorized-fl.epsilon", "factorized-fl.l1",
                   "factorized-fl.variant", "feddecomp.rank-conv", "feddecomp.rank-linear",
                   "feddecomp.lora-epochs"}
    assert design_keys <= set(config)


@pytest.mark.parametrize(("key", "value", "message"), [
    ("method", "fedfoo", "method: unknown value 'fedfoo'; allowed: fedavg, fedprox, local"),
    ("dataset", "imagenet", "dataset: unknown value 'imagenet'; allowed: digits"),
    ("model", "vgg", "model: unknown value 'vgg'; allowed: mlp, cnn, lenet5, resnet8"),
    ("partitioner", "shards", "partitioner: unknown value 'shards'; allowed: iid, dirichlet"),
    ("device", "tpu", "device: unknown value 'tpu'; allowed: auto, cpu, cuda, cuda:N"),
    ("dirichlet-alpha", 0.0, "dirichlet-alpha: 0.0 is out of range"),
    ("test-fraction", 1.5, "test-fraction: 1.5 is out of range"),
    ("lr", "fast", "lr: expected float, got 'fast'"),
    ("fedrep.head-epochs", 9, "fedrep.head-epochs: 9 leaves no epoch of local-epochs=2"),
    ("fedrep.head-epochs", 2, "fedrep.head-epochs: 2 leaves no epoch of local-epochs=2 to the "
                              "shared part; allowed: [0, 1]"),
    # NaN passes every range comparison; a TOML bool is an int to Python
    ("lr", float("nan"), "lr: nan is not a finite number"),
    ("dirichlet-alpha", float("inf"), "dirichlet-alpha: inf is not a finite number"),
    ("local-epochs", True, "local-epochs: expected int, got True"),
    ("lr", False, "lr: expected float, got False"),
])
def test_bad_values_raise_one_line(key, value, message):
    config = {**defaults(), key: value}
    if key == "fedrep.head-epochs":
        config["method"] = "fedrep"
    with pytest.raises(ConfigError) as error:
        load_settings(config)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_personal_phase_with_no_local_epoch_at_all_is_refused():
    """``local-epochs = 0`` leaves no epoch for a personal phase either."""
    config = {**defaults(), "method": "fedrep", "local-epochs": 0, "fedrep.head-epochs": 1}
    with pytest.raises(ConfigError, match=r"fedrep\.head-epochs: 1 leaves no epoch of "
                                          r"local-epochs=0"):
        load_settings(config)
