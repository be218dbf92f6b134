"""Data loading and partitioning: one client's train and test split for a run config.

``load_client_data`` is the single entry point of the ClientApp; ``dataset_shape`` tells the
ServerApp the input shape and number of classes without loading any data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from common.config import ConfigError, RunSettings
from fldata.partition import label_permutation, partition_indices, train_test_split
from fldata.sources import SyntheticFedFac, arrays_from_hf, digits_pool, load_local


@dataclass(frozen=True)
class DatasetInfo:
    input_shape: tuple[int, ...]
    num_classes: int
    default_model: str
    hub_id: str = ""           # Hugging Face dataset id, loaded through flwr-datasets
    hub_subset: str | None = None
    label_column: str = "label"


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo((1, 8, 8), 10, "cnn"),
    "synthetic-fedfac": DatasetInfo((0,), 2, "mlp"),   # (dim,) comes from synthetic.dim
    "mnist": DatasetInfo((1, 28, 28), 10, "cnn", "ylecun/mnist"),
    "fashion-mnist": DatasetInfo((1, 28, 28), 10, "cnn", "zalando-datasets/fashion_mnist"),
    "cifar10": DatasetInfo((3, 32, 32), 10, "resnet8", "uoft-cs/cifar10"),
    "cifar100": DatasetInfo((3, 32, 32), 100, "resnet9", "uoft-cs/cifar100",
                            label_column="fine_label"),
    "svhn": DatasetInfo((3, 32, 32), 10, "resnet8", "ufldl-stanford/svhn", "cropped_digits"),
}


def is_local_path(dataset: str) -> bool:
    """A ``dataset`` value that names a file or directory rather than a known dataset."""
    return dataset not in DATASETS and ("/" in dataset or dataset.endswith(".npz"))


@dataclass(frozen=True)
class ClientData:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int

    @property
    def classes_present(self) -> np.ndarray:
        """Label presence vector over all classes (from the train split)."""
        return np.bincount(self.y_train, minlength=self.num_classes) > 0


def synthetic_generator(settings: RunSettings) -> SyntheticFedFac:
    return SyntheticFedFac(
        dim=settings.setting("synthetic.dim", int),
        hidden=settings.setting("synthetic.hidden", int),
        shared_param_fraction=settings.setting("synthetic.shared-param-fraction"),
        shared_covariate_fraction=settings.setting("synthetic.shared-covariate-fraction"),
        noise=settings.setting("synthetic.noise"),
    )


def dataset_shape(settings: RunSettings) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of the run's dataset, without loading it."""
    if settings.dataset == "synthetic-fedfac":
        return (settings.setting("synthetic.dim", int),), 2
    if settings.dataset in DATASETS:
        info = DATASETS[settings.dataset]
        return info.input_shape, info.num_classes
    num_classes = settings.setting("num-classes", int, 0)
    shape = settings.setting("input-shape", str, "")
    if num_classes > 0 and shape:
        try:
            return tuple(int(s) for s in shape.split(",")), num_classes
        except ValueError:
            raise ConfigError(f"input-shape: {shape!r} is not a comma-separated list of "
                              "integers, e.g. '3,32,32'") from None
    x, y = load_local(settings.dataset)  # the server can read it: take the facts from it
    return tuple(x.shape[1:]), int(y.max()) + 1


def default_model(settings: RunSettings) -> str:
    if settings.model:
        return settings.model
    if settings.dataset in DATASETS:
        return DATASETS[settings.dataset].default_model
    shape, _ = dataset_shape(settings)
    return "mlp" if len(shape) == 1 else "cnn"


@lru_cache(maxsize=2)
def _pool(dataset: str) -> tuple[np.ndarray, np.ndarray]:
    if dataset == "digits":
        return digits_pool()
    return load_local(dataset)


def _hub_partition(settings: RunSettings, partition_id: int,
                   num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """One partition of a hub dataset's train split, through flwr-datasets (which caches
    the download on disk)."""
    from flwr_datasets import FederatedDataset

    from fldata.partition import make_partitioner

    info = DATASETS[settings.dataset]
    # The pool size only bounds Dirichlet's minimum partition size; hub sets are large.
    partitioner = make_partitioner(settings, num_partitions, pool_size=10**9,
                                   partition_by=info.label_column)
    fds = FederatedDataset(dataset=info.hub_id, subset=info.hub_subset,
                           partitioners={"train": partitioner}, shuffle=True,
                           seed=settings.seed)
    return arrays_from_hf(fds.load_partition(partition_id, "train"), info.label_column)


def partition_arrays(settings: RunSettings, partition_id: int,
                     num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """Partition ``partition_id`` of the run's dataset (train and test together)."""
    if settings.dataset == "synthetic-fedfac":
        return synthetic_generator(settings).client(
            settings.seed, partition_id, settings.setting("synthetic.num-samples", int))
    if settings.dataset in DATASETS and DATASETS[settings.dataset].hub_id:
        return _hub_partition(settings, partition_id, num_partitions)
    x_pool, y_pool = _pool(settings.dataset)
    idx = partition_indices(y_pool, settings, partition_id, num_partitions)
    return x_pool[idx], y_pool[idx]


def load_client_data(settings: RunSettings, partition_id: int, num_partitions: int,
                     data_dir: str | None = None) -> ClientData:
    """One client's train/test split.

    ``data_dir`` (a SuperNode's ``data-dir`` node config) is a device's own data: it is used
    whole, with no partitioning. Otherwise the run's dataset is partitioned over
    ``num_partitions`` clients and this client takes partition ``partition_id``.
    """
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id: {partition_id} is out of range; allowed: "
                          f"[0, {num_partitions - 1}]")
    _, num_classes = dataset_shape(settings)
    if data_dir:
        x, y = load_local(Path(data_dir))
    else:
        x, y = partition_arrays(settings, partition_id, num_partitions)
    # Split before permuting, so that permute-labels changes the labels and nothing else.
    train, test = train_test_split(y, settings.test_fraction, settings.seed, partition_id)
    if settings.permute_labels:
        y = label_permutation(num_classes, settings.seed, partition_id)[y]
    return ClientData(x[train], y[train], x[test], y[test], num_classes)
