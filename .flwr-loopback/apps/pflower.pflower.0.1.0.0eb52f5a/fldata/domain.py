"""``DomainPartitioner``: the one client layout flwr-datasets lacks (see ``partition.py``)."""

from __future__ import annotations

import datasets
import numpy as np
from flwr_datasets.partitioner import Partitioner

from common.config import ConfigError


class DomainPartitioner(Partitioner):
    """Clients in ``num_groups`` domains; each domain owns a disjoint block of classes.

    Classes are cut into ``num_groups`` consecutive blocks (Factorized-FL's CIFAR-100 domain
    setup, with class blocks standing in for superclasses). Client ``i`` belongs to domain
    ``i % num_groups`` and receives an IID share of its domain's examples.
    """

    def __init__(self, num_partitions: int, num_groups: int, partition_by: str = "label",
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
