"""The matrix's protocol: the data, the common settings, the scenarios and their rows, the
tuning grids (the same budget for every row), the ablations, and what a cell keeps of a run.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.data import ensure_dataset
from fldata.sources import idx_pool
from launch.comparison import config_tag

POOL_SIZE = 5000       # images drawn from the 60,000 (250 a client: the FedDecomp paper's size)
NUM_CLIENTS = 20
TUNING_SEED = 0
REPORT_SEEDS = (1, 2, 3)
COMMON: dict[str, Any] = {"num-server-rounds": 15, "local-epochs": 2, "batch-size": 32,
                          "momentum": 0.9, "test-fraction": 0.2, "plot": False}
BASELINES = ("fedavg", "fedprox", "local", "fedper", "fedrep", "fedbn", "fedavg-ft")
LEARNING_RATES = (0.01, 0.02, 0.05, 0.1)   # methods without a main hyperparameter
LEARNING_RATES_2 = (0.02, 0.05)             # with one: 2 x 2 runs, the same budget


@dataclass(frozen=True)
class Entry:
    """One row of a scenario: a method, with fixed overrides that make it a variant."""

    label: str
    method: str
    fixed: dict[str, Any] = field(default_factory=dict)


def entry(label: str, **fixed: Any) -> Entry:
    return Entry(label, label.split("@", 1)[0], {k.replace("__", "."): v
                                                 for k, v in fixed.items()})


FEDFAC_STATIC = entry("fedfac")
FEDFAC_DYNAMIC = entry("fedfac@dynamic", fedfac__mode="dynamic")

# Each method on its paper's scenario plus the shared Dirichlet 0.1, baselines everywhere.
SCENARIOS: dict[str, tuple[dict[str, Any], list[Entry]]] = {
    "dirichlet-0.1": ({"partitioner": "dirichlet", "dirichlet-alpha": 0.1},
                      [*map(entry, BASELINES), entry("feddecomp"), FEDFAC_STATIC,
                       FEDFAC_DYNAMIC, entry("pfedc"), entry("factorized-fl")]),
    "pathological-2": ({"partitioner": "pathological", "classes-per-client": 2},
                       [*map(entry, BASELINES), entry("pfedc")]),
    "permuted-labels": ({"partitioner": "iid", "permute-labels": True},
                        [*map(entry, BASELINES), entry("factorized-fl")]),
    "domain-groups": ({"partitioner": "domain", "domain-groups": 2},
                      [*map(entry, BASELINES), entry("factorized-fl")]),
    # FedFac's eq. 8 generator: its estimated split against the true and a random one
    "synthetic-fedfac": ({"dataset": "synthetic-fedfac", "partitioner": "iid"},
                         [entry("fedavg"), entry("local"), FEDFAC_STATIC, FEDFAC_DYNAMIC,
                          entry("fedfac@true-split", fedfac__split="true"),
                          entry("fedfac@random-split", fedfac__split="random")]),
}

# The one main hyperparameter each method is tuned on besides the learning rate.
MAIN_HYPERPARAMETER: dict[str, tuple[str, tuple[Any, ...]]] = {
    "fedprox": ("fedprox.mu", (0.01, 0.1)),
    "fedrep": ("fedrep.head-epochs", (1, 2)),
    "feddecomp": ("feddecomp.rank", (0.25, 0.5)),
    "fedfac": ("fedfac.tau-quantile", (0.3, 0.5)),
    "pfedc": ("pfedc.mgda", (True, False)),
    "factorized-fl": ("factorized-fl.l1", (0.0005, 0.005)),
}


SAME_SIZE_RANDOM_SPLIT = {"fedfac.split": "random"}


@dataclass(frozen=True)
class Ablation:
    """A row's tuned configuration with one change, on the report seeds (``--ablations``): a
    claim that did not hold, probed, or the reference a claim is judged against."""

    scenario: str
    label: str               # the row it varies
    change: dict[str, Any]   # replaces or adds keys of that row's tuned configuration
    question: str


ABLATIONS = [
    Ablation("dirichlet-0.1", "feddecomp", {"feddecomp.rank": 1.0},
             "Is the personal part too small? B A as large as the layer (rank ratio 1)."),
    Ablation("dirichlet-0.1", "feddecomp", {"feddecomp.bn-stats": "personal"},
             "Do averaged BatchNorm statistics cost it? Running statistics kept per client."),
    Ablation("permuted-labels", "factorized-fl", {"factorized-fl.tau": 1.0},
             "The factorized model or the matching? With tau = 1 a client averages only with "
             "matching vectors pointing exactly its way (itself): the model trained locally."),
    Ablation("permuted-labels", "factorized-fl", {"factorized-fl.variant": "u-paper"},
             "The paper's shared set: only u (biases and BatchNorm affine stay personal)."),
    Ablation("permuted-labels", "factorized-fl", {"factorized-fl.l1": 0.0},
             "Does the sparsity penalty on mu cost it? No L1."),
    # The reference FedFac's split claim needs: the row's own tuned configuration (so the
    # same tau-quantile, hence as many shared elements as estimated), the elements drawn at
    # random. The tuned ``fedfac@random-split`` row picks its own tau-quantile, so its split
    # need not have the estimate's size.
    *(Ablation("synthetic-fedfac", label, SAME_SIZE_RANDOM_SPLIT,
               "A random split of the same size: as many shared elements as estimated, "
               "chosen at random, all else the row's.")
      for label in ("fedfac", "fedfac@dynamic")),
]


def expand(config: dict[str, Any]) -> dict[str, Any]:
    """Run-config overrides of a tuning configuration (``feddecomp.rank`` sets both ranks)."""
    out = {k: v for k, v in config.items() if k != "feddecomp.rank"}
    if "feddecomp.rank" in config:  # a rank key given as well wins
        rank = config["feddecomp.rank"]
        out = {"feddecomp.rank-conv": rank, "feddecomp.rank-linear": rank, **out}
    return out


def tuning_grid(method: str) -> list[dict[str, Any]]:
    """The same budget for every method: four configurations."""
    if method not in MAIN_HYPERPARAMETER:
        return [{"lr": lr} for lr in LEARNING_RATES]
    name, values = MAIN_HYPERPARAMETER[method]
    return [{"lr": lr, name: v} for lr, v in itertools.product(LEARNING_RATES_2, values)]


def cell_path(out: Path, scenario: str, label: str, stage: str, config: dict[str, Any],
              seed: int) -> Path:
    return (out / "matrix" / "cells" / scenario / label.replace("@", "-")
            / f"{stage}-{config_tag(config)}-seed{seed}.json")


def comparable_config(run_config: dict[str, Any]) -> dict[str, Any]:
    """What a cell's numbers depend on: its run config without where it wrote, with the pool
    named by its file name (the cache folder differs between machines)."""
    return {k: Path(v).name if k == "dataset" and "/" in str(v) else v
            for k, v in run_config.items() if k != "output-dir"}


def pool_file(size: int = POOL_SIZE) -> Path:
    """The subsample of Fashion-MNIST's training images every cell reads, written once."""
    path = Path("~/.cache/pflower/bench").expanduser() / f"fashion-mnist-{size}.npz"
    if not path.exists():
        found = ensure_dataset("fashion-mnist")
        if found is None:
            raise SystemExit(1)
        x, y = idx_pool(found)
        chosen = np.random.default_rng(0).choice(len(y), size, replace=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path.with_suffix(".tmp.npz"), x=x[chosen], y=y[chosen])
        path.with_suffix(".tmp.npz").replace(path)
    return path


