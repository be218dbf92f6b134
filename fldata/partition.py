"""Partitioning a labelled pool over clients, label permutation and local train/test splits.

The partitioners are flwr-datasets' own (``IidPartitioner``, ``DirichletPartitioner``,
``PathologicalPartitioner``) plus ``DomainPartitioner`` for the one layout flwr-datasets lacks.
All of them work on a ``datasets.Dataset`` with a ``label`` column, whether it came from the
Hugging Face hub (``FederatedDataset``) or was built in memory.
"""

from __future__ import annotations

import datasets
import numpy as np
from flwr_datasets.partitioner import (
    DirichletPartitioner,
    IidPartitioner,
    Partitioner,
    PathologicalPartitioner,
)

from common.config import ConfigError, RunSettings

LABEL = "label"


class DomainPartitioner(Partitioner):
    """Clients in ``num_groups`` domains; each domain owns a disjoint block of classes.

    Classes are cut into ``num_groups`` consecutive blocks (Factorized-FL's CIFAR-100 domain
    setup, with class blocks standing in for superclasses). Client ``i`` belongs to domain
    ``i % num_groups`` and receives an IID share of its domain's examples.
    """

    def __init__(self, num_partitions: int, num_groups: int, partition_by: str = LABEL,
                 seed: int = 42) -> None:
        super().__init__()
        self._partition_by = partition_by
        if num_groups > num_partitions:
            raise ConfigError(f"domain-groups: {num_groups} is out of range; allowed: "
                              f"[1, num-partitions={num_partitions}]")
        self._num_partitions = num_partitions
        self._num_groups = num_groups
        self._seed = seed
        self._indices: dict[int, np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def domain_of_client(self, partition_id: int) -> int:
        return partition_id % self._num_groups

    def domain_of_class(self, label: np.ndarray, num_classes: int) -> np.ndarray:
        return np.minimum(label * self._num_groups // num_classes, self._num_groups - 1)

    def _assign(self) -> dict[int, np.ndarray]:
        labels = np.asarray(self.dataset[self._partition_by])
        num_classes = int(labels.max()) + 1
        if num_classes < self._num_groups:
            raise ConfigError(f"domain-groups: {self._num_groups} is out of range; allowed: "
                              f"[1, number of classes={num_classes}]")
        domain = self.domain_of_class(labels, num_classes)
        rng = np.random.default_rng(self._seed)
        indices: dict[int, np.ndarray] = {}
        for group in range(self._num_groups):
            clients = [c for c in range(self._num_partitions)
                       if self.domain_of_client(c) == group]
            members = rng.permutation(np.flatnonzero(domain == group))
            for client, share in zip(clients, np.array_split(members, len(clients)),
                                     strict=True):
                indices[client] = np.sort(share)
        return indices

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        if self._indices is None:
            self._indices = self._assign()
        return self.dataset.select(self._indices[partition_id])


def make_partitioner(settings: RunSettings, num_partitions: int, pool_size: int,
                     partition_by: str = LABEL) -> Partitioner:
    """The flwr-datasets partitioner named by ``settings.partitioner``."""
    if settings.partitioner == "iid":
        return IidPartitioner(num_partitions)
    if settings.partitioner == "dirichlet":
        return DirichletPartitioner(
            num_partitions, partition_by, settings.dirichlet_alpha,
            min_partition_size=min(10, pool_size // (2 * num_partitions)),
            self_balancing=False, shuffle=True, seed=settings.seed)
    if settings.partitioner == "pathological":
        # "deterministic": client i holds classes i, i+1, ..., i+k-1 (mod C), so neighbouring
        # clients overlap and, with num_partitions * k >= C, every class is used.
        return PathologicalPartitioner(
            num_partitions, partition_by, settings.classes_per_client,
            class_assignment_mode="deterministic", shuffle=True, seed=settings.seed)
    return DomainPartitioner(num_partitions, settings.domain_groups, partition_by,
                             seed=settings.seed)


def partition_indices(labels: np.ndarray, settings: RunSettings, partition_id: int,
                      num_partitions: int) -> np.ndarray:
    """Indices into ``labels`` of one client's examples (train and test together)."""
    # flwr-datasets' IidPartitioner shards contiguously: shuffle the pool first (seeded) so
    # that every partitioner sees the same, order-free pool.
    order = np.random.default_rng(settings.seed).permutation(len(labels))
    pool = datasets.Dataset.from_dict({"idx": order, LABEL: labels[order]})
    partitioner = make_partitioner(settings, num_partitions, len(labels))
    partitioner.dataset = pool
    return np.sort(np.asarray(partitioner.load_partition(partition_id)["idx"], dtype=np.int64))


def label_permutation(num_classes: int, seed: int, partition_id: int) -> np.ndarray:
    """Client ``partition_id``'s own bijection of the label set (``permute-labels``)."""
    return np.random.default_rng([seed, 7919, partition_id]).permutation(num_classes)


def train_test_split(labels: np.ndarray, test_fraction: float, seed: int,
                     partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Stratified split of one client's examples: the test split has the train split's mix.

    Per class, ``round(test_fraction * n)`` examples go to test (a class with a single
    example stays in train). Returns (train positions, test positions).
    """
    rng = np.random.default_rng([seed, 104729, partition_id])
    train, test = [], []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_test = round(test_fraction * len(members)) if len(members) > 1 else 0
        test.append(members[:n_test])
        train.append(members[n_test:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))
