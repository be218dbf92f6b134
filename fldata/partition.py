"""Partitioning a labelled pool over clients, label permutation, feature shift and local
train/test splits.

The partitioners are flwr-datasets' own (``IidPartitioner``, ``DirichletPartitioner``,
``PathologicalPartitioner``) plus ``DomainPartitioner`` for the one layout flwr-datasets lacks.
All of them work on a ``datasets.Dataset`` with a ``label`` column, whether it came from the
Hugging Face hub (``FederatedDataset``) or was built in memory.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import TYPE_CHECKING

import numpy as np

from common.config import ConfigError, RunSettings

if TYPE_CHECKING:  # flwr-datasets and datasets load in seconds: only where a pool is split
    from flwr_datasets.partitioner import Partitioner

LABEL = "label"


def make_partitioner(settings: RunSettings, num_partitions: int, pool_size: int,
                     partition_by: str = LABEL) -> Partitioner:
    """The flwr-datasets partitioner named by ``settings.partitioner``."""
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        PathologicalPartitioner,
    )

    from fldata.domain import DomainPartitioner

    if settings.partitioner == "iid":
        return IidPartitioner(num_partitions)
    if settings.partitioner == "natural":
        return NaturalIdPartitioner(partition_by=settings.partition_column)
    if settings.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions, partition_by, settings.dirichlet_alpha,
            min_partition_size=min_partition_size(settings, num_partitions, pool_size),
            self_balancing=False, shuffle=True, seed=settings.seed)
    if settings.partitioner == "pathological":
        # "deterministic": client i holds classes i, i+1, ..., i+k-1 (mod C), so neighbouring
        # clients overlap and, with num_partitions * k >= C, every class is used.
        return PathologicalPartitioner(
            num_partitions, partition_by, settings.classes_per_client,
            class_assignment_mode="deterministic", shuffle=True, seed=settings.seed)
    return DomainPartitioner(num_partitions, settings.domain_groups, partition_by,
                             seed=settings.seed)


def natural_indices(ids: np.ndarray, column: str, partition_id: int,
                    num_partitions: int) -> np.ndarray:
    """Indices of client ``partition_id``'s examples under the natural partitioner: one
    client per distinct value of ``ids`` (the dataset's ``column``: a writer, a site, a
    device), in sorted order of the values (flwr-datasets' ``NaturalIdPartitioner``). A run
    with another number of clients stops with one line."""
    import datasets
    from flwr_datasets.partitioner import NaturalIdPartitioner

    partitioner = NaturalIdPartitioner(partition_by=column)
    partitioner.dataset = datasets.Dataset.from_dict({"idx": np.arange(len(ids)),
                                                      column: ids.tolist()})
    if partitioner.num_partitions != num_partitions:
        raise ConfigError(f"partition-column: {column!r} holds {partitioner.num_partitions} "
                          f"distinct values, one client each, but the run has "
                          f"{num_partitions} clients (SUPERNODES, or the sites' "
                          "num-partitions)")
    return np.sort(np.asarray(partitioner.load_partition(partition_id)["idx"], dtype=np.int64))


def min_partition_size(settings: RunSettings, num_partitions: int, pool_size: int) -> int:
    """Dirichlet: the fewest examples a client may get (``min-partition-size``, at most half
    an even share, so that small pools stay drawable)."""
    return min(settings.min_partition_size, pool_size // (2 * num_partitions))


# Partitioners whose draw succeeded, per (labels, partition settings, number of partitions):
# flwr-datasets' partitioners draw every partition at their first ``load_partition`` and keep
# them, so a process that serves many clients (a simulation worker) partitions the pool once
# instead of once per client. A partitioner whose draw failed is never kept: its generator
# has moved on, and a second ``load_partition`` would draw from where the failed tries left
# it, so that a client's partition would depend on what its process ran before. A few entries
# at most: a process serves one run at a time.
_PARTITIONERS: dict[tuple, Partitioner] = {}
_KEEP = 4


def _partition_settings(settings: RunSettings) -> tuple:
    return (settings.partitioner, settings.dirichlet_alpha, settings.min_partition_size,
            settings.classes_per_client, settings.domain_groups, settings.seed)


def drawn_partitioner(labels: np.ndarray, settings: RunSettings,
                      num_partitions: int) -> Partitioner:
    """The run's partitioner with every partition of ``labels`` drawn, a pure function of
    the labels, the partition settings, the seed and the number of partitions: made fresh
    and drawn once per process (kept after a successful draw). A pool it cannot split raises
    a one-line ``ConfigError`` naming what to change, the same in every process."""
    key = (hashlib.sha1(np.ascontiguousarray(labels).tobytes()).hexdigest(), labels.dtype.str,
           len(labels), _partition_settings(settings), num_partitions)
    partitioner = _PARTITIONERS.get(key)
    if partitioner is not None:
        return partitioner
    # flwr-datasets' IidPartitioner shards contiguously: shuffle the pool first (seeded)
    # so that every partitioner sees the same, order-free pool.
    import datasets

    order = np.random.default_rng(settings.seed).permutation(len(labels))
    partitioner = make_partitioner(settings, num_partitions, len(labels))
    partitioner.dataset = datasets.Dataset.from_dict({"idx": order, LABEL: labels[order]})
    try:
        with warnings.catch_warnings():  # its "will be repeated" lines: the refusal says it
            warnings.simplefilter("ignore", UserWarning)
            partitioner.load_partition(0)  # draws them all
    except ValueError as error:
        raise _undrawable(labels, settings, num_partitions, error) from error
    while len(_PARTITIONERS) >= _KEEP:
        _PARTITIONERS.pop(next(iter(_PARTITIONERS)))
    _PARTITIONERS[key] = partitioner
    return partitioner


def _undrawable(labels: np.ndarray, settings: RunSettings, num_partitions: int,
                error: ValueError) -> ConfigError:
    if settings.partitioner != "dirichlet":
        return ConfigError(f"partitioner: {settings.partitioner} cannot split this pool of "
                           f"{len(labels)} examples in {len(np.unique(labels))} classes over "
                           f"{num_partitions} clients: {error}")
    # flwr-datasets redraws up to 10 times while a client has too few examples; many
    # clients on a small pool (1,000 clients of 20 examples on average) never get there
    smallest = min_partition_size(settings, num_partitions, len(labels))
    lower = ("lower min-partition-size (2 keeps one train and one test example), "
             if smallest > 2 else "")
    return ConfigError(
        f"dirichlet: no draw in 10 gave each of {num_partitions} clients at least "
        f"{smallest} of the pool's {len(labels)} examples (dirichlet-alpha="
        f"{settings.dirichlet_alpha}); {lower}raise dirichlet-alpha, or use fewer clients")


def partition_indices(labels: np.ndarray, settings: RunSettings, partition_id: int,
                      num_partitions: int) -> np.ndarray:
    """Indices into ``labels`` of one client's examples (train and test together)."""
    partitioner = drawn_partitioner(labels, settings, num_partitions)
    return np.sort(np.asarray(partitioner.load_partition(partition_id)["idx"], dtype=np.int64))


def label_permutation(num_classes: int, seed: int, partition_id: int) -> np.ndarray:
    """Client ``partition_id``'s own bijection of the label set (``permute-labels``)."""
    return np.random.default_rng([seed, 7919, partition_id]).permutation(num_classes)


def check_feature_shift(shift: str, example_shape: tuple[int, ...]) -> None:
    """``feature-shift = "rotate"`` turns images in their plane: it needs (C, H, W) examples
    with H == W, else a rotated client's inputs would not fit the model."""
    if shift != "none" and (len(example_shape) != 3 or example_shape[1] != example_shape[2]):
        raise ConfigError(f"feature-shift: {shift!r} needs square images (C, H, W with H == W); "
                          f"this dataset's examples have shape {tuple(example_shape)}")


def feature_shift(x: np.ndarray, shift: str, groups: int, partition_id: int) -> np.ndarray:
    """Client ``partition_id``'s examples ``x`` (N, C, H, W) under ``feature-shift``: with
    ``"rotate"``, client ``partition_id`` is in group ``partition_id % groups`` and its images
    are turned by ``group * 90`` degrees (``np.rot90`` over the last two axes: exact, no
    interpolation), so that groups differ in their inputs and not in their labels."""
    check_feature_shift(shift, tuple(x.shape[1:]))
    group = partition_id % groups
    if shift == "none" or group == 0:
        return x
    return np.rot90(x, group, axes=(-2, -1))


TEST_STREAM = 104729        # the random streams of a client's two splits: independent
VALIDATION_STREAM = 130363
POOL_PART_SEED = 611953     # the pool's tuning/report cut: one for every run seed


def pool_part(labels: np.ndarray, part: str, tuning_share: float) -> np.ndarray:
    """Positions in the pool of ``part`` (``pool-part``): ``""`` all of it; ``"tuning"``,
    per class, ``round(tuning_share * n)`` examples drawn with a fixed seed (the same for
    every run seed, so that the cut is one), and ``"report"`` the rest. A comparison tunes on
    one part and reports on the other: no image a configuration was chosen on is in any
    report seed's split."""
    if not part:
        return np.arange(len(labels))
    rng = np.random.default_rng(POOL_PART_SEED)
    tuning = np.concatenate([
        (members := rng.permutation(np.flatnonzero(labels == label)))[
            :round(tuning_share * len(members))] for label in np.unique(labels)])
    chosen = np.zeros(len(labels), dtype=bool)
    chosen[tuning] = True
    return np.flatnonzero(chosen if part == "tuning" else ~chosen)


def train_test_split(labels: np.ndarray, test_fraction: float, seed: int,
                     partition_id: int, stream: int = TEST_STREAM
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split of one client's examples: the test split has the train split's mix.

    Per class, ``round(test_fraction * n)`` examples go to test (a class with a single
    example stays in train). A client that would have no test example this way (a few
    examples of different classes, as with 1,000 clients on a small pool) keeps one of them
    back, so that it can still be evaluated. Returns (train positions, test positions).
    ``stream`` tells this split's random draws from another's of the same client (the
    validation split is carved from the training share with ``VALIDATION_STREAM``).
    """
    rng = np.random.default_rng([seed, stream, partition_id])
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_test = round(test_fraction * len(members)) if len(members) > 1 else 0
        test.append(members[:n_test])
        train.append(members[n_test:])
    train_positions, test_positions = np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
    if len(test_positions) == 0 and len(train_positions) > 1:
        kept = rng.integers(len(train_positions))
        test_positions = train_positions[kept:kept + 1]
        train_positions = np.delete(train_positions, kept)
    return train_positions, test_positions


def split_positions(y: np.ndarray, settings: RunSettings, partition_id: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Positions in a client's labels ``y`` of the examples it trains on and of those it is
    evaluated on: its test split, or its validation split (carved from the training share)
    where ``validation-fraction`` is above 0."""
    train, test = train_test_split(y, settings.test_fraction, settings.seed, partition_id)
    if settings.validation_fraction > 0:  # carved from the training share; the test split unused
        fit, validation = train_test_split(y[train], settings.validation_fraction, settings.seed,
                                           partition_id, stream=VALIDATION_STREAM)
        train, test = train[fit], train[validation]
    return train, test


# A client evaluated on fewer examples than this scores in steps of more than 20 points
SMALL_TEST_SPLIT = 5


def check_split_sizes(client_labels: list[np.ndarray], settings: RunSettings) -> str | None:
    """Every client's split, from its labels (``client_labels[i]``: partition ``i``'s):
    raises a one-line ``ConfigError`` naming the fix when a client gets no training or no
    evaluation example; returns a warning (or None) when some clients are evaluated on fewer
    than ``SMALL_TEST_SPLIT`` examples."""
    num_partitions = len(client_labels)
    sizes = np.array([[len(s) for s in split_positions(y, settings, pid)] if len(y) else [0, 0]
                      for pid, y in enumerate(client_labels)])
    evaluated_on = "validation" if settings.validation_fraction > 0 else "test"
    for column, split in ((0, "training"), (1, evaluated_on)):
        empty = np.flatnonzero(sizes[:, column] == 0)
        if len(empty):
            pool = sum(map(len, client_labels))
            fixes = ("use fewer clients, raise min-partition-size or dirichlet-alpha"
                     if settings.partitioner == "dirichlet"
                     and min_partition_size(settings, num_partitions, pool) > 0
                     else "use fewer clients")
            raise ConfigError(
                f"partitioner: {len(empty)} of {num_partitions} clients get no {split} "
                f"example from the pool of {pool} (client "
                f"{empty[0]} holds {len(client_labels[empty[0]])} examples); {fixes}")
    small = sizes[:, 1] < SMALL_TEST_SPLIT
    if not small.any():
        return None
    return (f"{small.sum()} of {num_partitions} clients are evaluated on fewer than "
            f"{SMALL_TEST_SPLIT} {evaluated_on} examples (the smallest on "
            f"{sizes[:, 1].min()}): their accuracy moves in steps of "
            f"{100 / sizes[:, 1].min():.0f} points or more")
