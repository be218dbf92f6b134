"""Data loading and partitioning: one client's train and test split for a run config.

``load_client_data`` is the single entry point of the ClientApp; ``dataset_shape`` tells the
ServerApp the input shape and number of classes without loading any data (for a named
dataset).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from common.config import ConfigError, KeyGroup, RunSettings, in_range, key, one_of
from fldata.cache import cache_key, cached_split, fingerprint
from fldata.idx import find_idx_dir, search_dirs
from fldata.partition import (
    check_feature_shift,
    check_split_sizes,
    feature_shift,
    label_permutation,
    natural_indices,
    partition_indices,
    pool_part,
    split_positions,
)
from fldata.sources import (
    DATA_FILES,
    SyntheticFedFac,
    arrays_from_hf,
    digits_pool,
    hub_unreachable,
    load_column,
    load_local,
)


@dataclass(frozen=True)
class DatasetInfo:
    input_shape: tuple[int, ...]
    num_classes: int
    default_model: str
    hub_id: str = ""           # Hugging Face dataset id, loaded through flwr-datasets
    hub_subset: str | None = None
    label_column: str = "label"
    idx: bool = False          # a local copy in IDX files is used before the hub
    system_dir: str = ""       # where a system package installs those files


DATASETS: dict[str, DatasetInfo] = {
    "digits": DatasetInfo((1, 8, 8), 10, "cnn"),
    "synthetic-fedfac": DatasetInfo((0,), 2, "mlp"),   # (dim,) comes from synthetic.dim
    "mnist": DatasetInfo((1, 28, 28), 10, "cnn", "ylecun/mnist", idx=True),
    "fashion-mnist": DatasetInfo((1, 28, 28), 10, "cnn", "zalando-datasets/fashion_mnist",
                                 idx=True, system_dir="/usr/share/datasets/fashion-mnist"),
    "cifar10": DatasetInfo((3, 32, 32), 10, "resnet8", "uoft-cs/cifar10"),
    "cifar100": DatasetInfo((3, 32, 32), 100, "resnet9", "uoft-cs/cifar100",
                            label_column="fine_label"),
    "svhn": DatasetInfo((3, 32, 32), 10, "resnet8", "ufldl-stanford/svhn", "cropped_digits"),
}


LOCAL_SUFFIXES = (".npz", *DATA_FILES)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_id(dataset: str) -> bool:
    """``org/name`` that is neither a named dataset nor a path on this machine (nor a data
    file's name): a Hugging Face hub dataset, loaded through flwr-datasets."""
    return (dataset not in DATASETS and HUB_ID.fullmatch(dataset) is not None
            and not Path(dataset).exists() and Path(dataset).suffix.lower() not in LOCAL_SUFFIXES)


def is_local_path(dataset: str) -> bool:
    """A ``dataset`` value that names a file or directory rather than a known dataset."""
    return dataset not in DATASETS and not is_hub_id(dataset) and (
        "/" in dataset or Path(dataset).suffix.lower() in LOCAL_SUFFIXES
        or Path(dataset).exists())


@dataclass(frozen=True)
class ClientData:
    """A client's training examples and the examples it is evaluated on: its test split, or
    its validation split where ``validation-fraction`` is above 0 (then the test split is
    never loaded into a run, so that a tuning run cannot see it)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int


@dataclass(frozen=True)
class SyntheticSettings(KeyGroup):
    """The ``synthetic.*`` keys of ``dataset = "synthetic-fedfac"``."""

    num_samples: int = key("synthetic.num-samples", low=1)
    dim: int = key("synthetic.dim", low=1)
    hidden: int = key("synthetic.hidden", low=1)
    shared_param_fraction: float = key("synthetic.shared-param-fraction", low=0, high=1)
    shared_covariate_fraction: float = key("synthetic.shared-covariate-fraction", low=0, high=1)
    noise: float = key("synthetic.noise", low=0)


def check_dataset(settings: RunSettings) -> None:
    """A known dataset, a local path or a hub id; the synthetic keys when they are used; a
    pathological partition that a named dataset's classes can serve; square images for a
    feature shift."""
    if not is_local_path(settings.dataset) and not is_hub_id(settings.dataset):
        one_of("dataset", settings.dataset,
               [*DATASETS, "<a local path>", "<org/name of a Hugging Face dataset>"])
    if settings.dataset == "synthetic-fedfac":
        SyntheticSettings.parse(settings.raw)
    if settings.dataset in DATASETS and settings.partitioner == "pathological":
        _, num_classes = dataset_shape(settings)
        in_range("classes-per-client", settings.classes_per_client, 1, num_classes)
    if settings.feature_shift != "none":
        check_feature_shift(settings.feature_shift, dataset_shape(settings)[0])


def check_local_files(settings: RunSettings) -> None:
    """The files the run config names exist on this machine (``data-root``, a local
    ``dataset`` path): for a launcher whose sites are this machine (a simulation), before
    anything starts. A deployment's sites check their own, at the preflight."""
    if settings.data_root and not Path(settings.data_root).is_dir():
        raise ConfigError(f"data-root: no such directory: {settings.data_root}")
    local_copy(settings)
    if is_local_path(settings.dataset) and not Path(settings.dataset).exists():
        raise ConfigError(f"dataset: no such file or directory: {settings.dataset}")


def synthetic_generator(settings: RunSettings) -> SyntheticFedFac:
    synthetic = SyntheticSettings.parse(settings.raw)
    return SyntheticFedFac(
        dim=synthetic.dim,
        hidden=synthetic.hidden,
        shared_param_fraction=synthetic.shared_param_fraction,
        shared_covariate_fraction=synthetic.shared_covariate_fraction,
        noise=synthetic.noise,
    )


def dataset_shape(settings: RunSettings) -> tuple[tuple[int, ...], int]:
    """(input shape, number of classes) of the run's dataset: from its table entry or from
    ``input-shape`` and ``num-classes`` when known, else read off its pool (a local file or
    digits: loaded once per process, ``_local_pool``'s cache)."""
    if settings.dataset == "synthetic-fedfac":
        return (SyntheticSettings.parse(settings.raw).dim,), 2
    if settings.dataset in DATASETS:
        info = DATASETS[settings.dataset]
        return info.input_shape, info.num_classes
    num_classes, shape = settings.num_classes, settings.input_shape
    if num_classes > 0 and shape:
        try:
            return tuple(int(s) for s in shape.split(",")), num_classes
        except ValueError:
            raise ConfigError(f"input-shape: {shape!r} is not a comma-separated list of "
                              "integers, e.g. '3,32,32'") from None
    if is_hub_id(settings.dataset):
        raise ConfigError(f"dataset: {settings.dataset} is no file or folder in {Path.cwd()}, "
                          "so it is read as a Hugging Face hub id, which the server does not "
                          "download: set num-classes and input-shape (e.g. "
                          "input-shape='3,32,32'), or give the local path in full")
    x, y = _pool(settings)  # the server can read it: take the facts from it
    return tuple(x.shape[1:]), int(y.max()) + 1


def default_model(settings: RunSettings) -> str:
    if settings.model:
        return settings.model
    if settings.dataset in DATASETS:
        return DATASETS[settings.dataset].default_model
    shape, _ = dataset_shape(settings)
    return "mlp" if len(shape) == 1 else "cnn"


def local_copy(settings: RunSettings) -> Path | None:
    """The directory of IDX files that a named dataset (``mnist``, ``fashion-mnist``) is read
    from instead of the hub, or None (then it comes from the hub).

    ``data-root`` set: ``<data-root>/<dataset>`` or ``data-root`` itself must hold the four
    files, else loading fails with one line (no silent download). Empty: the first of
    ``$PFLOWER_DATA_ROOT/<dataset>``, ``~/.cache/pflower/<dataset>`` and the system
    package's folder that holds them (``fldata.idx.search_dirs``)."""
    info = DATASETS.get(settings.dataset)
    if info is None or not info.idx:
        return None
    data_root = settings.data_root
    found = find_idx_dir(settings.dataset, data_root, info.system_dir)
    if found is None and data_root:
        raise ConfigError(f"data-root: no {settings.dataset} IDX files (train-images-idx3-ubyte"
                          f"[.gz] and the other three) in "
                          f"{' or '.join(map(str, search_dirs(settings.dataset, data_root)))}")
    return found


def pool_source(settings: RunSettings) -> str | None:
    """What ``_pool`` loads the run's pool from (``digits``, a local path, a named dataset's
    local copy), or None for a dataset that comes partitioned from the hub."""
    if is_hub_id(settings.dataset):
        return None
    if settings.dataset in DATASETS and DATASETS[settings.dataset].hub_id:
        found = local_copy(settings)
        return None if found is None else str(found)
    return settings.dataset


def _pool(settings: RunSettings, source: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The pool of ``source`` (default: the run's dataset), read with the run's columns."""
    source = settings.dataset if source is None else source
    if source == "digits":
        return digits_pool()
    return _local_pool(source, json.dumps(fingerprint(source)), settings.label_column,
                       settings.image_column)


@lru_cache(maxsize=2)
def _local_pool(path: str, version: str, label_column: str, image_column: str
                ) -> tuple[np.ndarray, np.ndarray]:
    """A local pool, kept while its files (``version``: their fingerprint) stay the same."""
    return load_local(path, label_column, image_column)


def _checked_pool(settings: RunSettings, source: str) -> tuple[np.ndarray, np.ndarray]:
    """The pool, checked against what a named dataset promises the server (input shape,
    number of classes): a local copy of the wrong dataset stops the run with one line."""
    x, y = _pool(settings, source)
    info = DATASETS.get(settings.dataset)
    if info is not None and info.idx and (tuple(x.shape[1:]) != info.input_shape
                                          or int(y.max()) >= info.num_classes):
        raise ConfigError(f"dataset: the local copy in {source} holds {len(x)} examples of "
                          f"shape {tuple(x.shape[1:])} in {int(y.max()) + 1} classes; "
                          f"{settings.dataset} has shape {info.input_shape} in "
                          f"{info.num_classes} classes")
    return x, y


def _hub_partition(settings: RunSettings, partition_id: int,
                   num_partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """One partition of a hub dataset's train split (a named one, or any ``org/name`` with
    the run's columns), through flwr-datasets (which caches the download on disk)."""
    from flwr_datasets import FederatedDataset

    from fldata.partition import make_partitioner

    info = DATASETS.get(settings.dataset) or DatasetInfo(
        (), 0, "", hub_id=settings.dataset, label_column=settings.label_column)
    if (reason := hub_unreachable(info.hub_id)) is not None:
        # else each client would retry the hub for about 25 s before failing
        searched = search_dirs(settings.dataset, "", info.system_dir)
        where = (f"no IDX files in {' or '.join(map(str, searched))}"
                 " (data-root names a folder of them), and " if info.idx else "")
        raise ConfigError(f"dataset: {settings.dataset} is not on this machine: {where}"
                          f"{info.hub_id} cannot be downloaded: {reason}")
    # The pool size only bounds Dirichlet's minimum partition size; hub sets are large.
    partitioner = make_partitioner(settings, num_partitions, pool_size=10**9,
                                   partition_by=info.label_column)
    fds = FederatedDataset(dataset=info.hub_id, subset=info.hub_subset,
                           partitioners={"train": partitioner}, shuffle=True,
                           seed=settings.seed)
    part = fds.load_partition(partition_id, "train")
    if not np.issubdtype(np.asarray(part[info.label_column][:1]).dtype, np.integer):
        # names would be numbered per partition, differently on each client
        raise ConfigError(f"label-column: {settings.dataset}'s {info.label_column!r} holds "
                          "names, not class ids; a hub dataset's labels must be class ids")
    image_column = "" if settings.dataset in DATASETS else settings.image_column
    return arrays_from_hf(part, info.label_column, image_column)


def partition_arrays(settings: RunSettings, partition_id: int, num_partitions: int,
                     source: str | None) -> tuple[np.ndarray, np.ndarray]:
    """Partition ``partition_id`` of the run's dataset (train and test together), its pool
    read from ``source`` (``pool_source``: looked up once by the caller, so that what it
    reads is what the partition cache's key names)."""
    if settings.dataset == "synthetic-fedfac":
        return synthetic_generator(settings).client(
            settings.seed, partition_id, SyntheticSettings.parse(settings.raw).num_samples)
    if source is None:
        if settings.pool_part:
            raise ConfigError(f"pool-part: {settings.dataset} is partitioned as flwr-datasets "
                              "loads it from the hub, whole; give a local copy's path to cut "
                              "its pool")
        return _hub_partition(settings, partition_id, num_partitions)
    x_pool, y_pool = _checked_pool(settings, source)
    keep = _pool_part(settings, y_pool)
    idx = _client_indices(settings, source, y_pool, keep, partition_id, num_partitions)
    if keep is not None:
        idx = keep[idx]
    return x_pool[idx], y_pool[idx]


def _pool_part(settings: RunSettings, y_pool: np.ndarray) -> np.ndarray | None:
    """Positions of the run's ``pool-part`` in the pool (None: the whole pool)."""
    return (pool_part(y_pool, settings.pool_part, settings.tuning_share)
            if settings.pool_part else None)


def _client_indices(settings: RunSettings, source: str, y_pool: np.ndarray,
                    keep: np.ndarray | None, partition_id: int, num_partitions: int
                    ) -> np.ndarray:
    """Client ``partition_id``'s positions in the pool's part ``keep`` (None: the pool)."""
    if settings.partitioner == "natural":
        ids = _natural_ids(source, json.dumps(fingerprint(source)), settings.partition_column)
        return natural_indices(ids if keep is None else ids[keep], settings.partition_column,
                               partition_id, num_partitions)
    return partition_indices(y_pool if keep is None else y_pool[keep], settings, partition_id,
                             num_partitions)


@lru_cache(maxsize=2)
def _natural_ids(path: str, version: str, column: str) -> np.ndarray:
    """The column the natural partitioner splits a local pool by, kept while its files
    (``version``) stay the same."""
    return load_column(path, column)


def load_client_data(settings: RunSettings, partition_id: int, num_partitions: int,
                     data_dir: str | None = None, cache_dir: Path | None = None) -> ClientData:
    """One client's train/test split.

    ``data_dir`` (a SuperNode's ``data-dir`` node config) is a device's own data: it is used
    whole, with no partitioning and no ``feature-shift`` (a real site's own data is already
    its own domain). Otherwise the run's dataset is partitioned over
    ``num_partitions`` clients and this client takes partition ``partition_id``. With
    ``cache_dir`` the split is computed once and memory-mapped after (``fldata/cache.py``).
    """
    if not 0 <= partition_id < num_partitions:
        raise ConfigError(f"partition-id: {partition_id} is out of range; allowed: "
                          f"[0, {num_partitions - 1}]")
    _, num_classes = dataset_shape(settings)
    # where the pool is read from: a local path, or the local copy of a named dataset the
    # search finds (data-root, $PFLOWER_DATA_ROOT, ...); None: the hub; a dataset's own name:
    # made in memory (digits, synthetic-fedfac), no file
    pool = None if data_dir else pool_source(settings)

    def compute() -> dict[str, np.ndarray]:
        return _split(settings, partition_id, num_partitions, num_classes, data_dir, pool)

    if cache_dir is None:
        split = compute()
    else:
        if data_dir:  # a device's own data, used whole
            sources = [fingerprint(data_dir)]
        else:  # the files the pool is read from
            sources = [["pool", pool,
                        None if pool is None or pool in DATASETS else fingerprint(pool)]]
        split = cached_split(cache_dir, cache_key(
            {**settings.raw, "data-dir": data_dir}, partition_id, num_partitions, sources),
            compute)
    return ClientData(split["x_train"], split["y_train"], split["x_test"], split["y_test"],
                      num_classes)


def check_partition(settings: RunSettings, num_partitions: int) -> str | None:
    """The whole partition of the run's pool over ``num_partitions`` clients, drawn once on
    the pool's labels before any client starts, as every client will draw it
    (``fldata.partition``: a pure function), and checked (``check_split_sizes``: raises a
    one-line ``ConfigError`` naming the fix, returns a warning or None). A pool this
    machine does not hold (a hub dataset) and the synthetic generator (a client's own draw)
    are not checked here."""
    source = pool_source(settings)
    if settings.dataset == "synthetic-fedfac" or source is None:
        return None
    _, y_pool = _checked_pool(settings, source)
    keep = _pool_part(settings, y_pool)
    y_part = y_pool if keep is None else y_pool[keep]
    return check_split_sizes([y_part[_client_indices(settings, source, y_pool, keep, pid,
                                                     num_partitions)]
                              for pid in range(num_partitions)], settings)


def _split(settings: RunSettings, partition_id: int, num_partitions: int, num_classes: int,
           data_dir: str | None, pool: str | None) -> dict[str, np.ndarray]:
    if data_dir:
        x, y = load_local(Path(data_dir), settings.label_column, settings.image_column)
    else:
        x, y = partition_arrays(settings, partition_id, num_partitions, pool)
        if len(y) == 0:  # where no launcher drew the whole partition first (a plain flwr run)
            raise ConfigError(f"partitioner: client {partition_id} of {num_partitions} gets no "
                              "example of the pool; use fewer clients")
    # Split before permuting and shifting, so that permute-labels changes the labels and
    # feature-shift the images, and nothing else: the same examples, in the same order.
    train, test = split_positions(y, settings, partition_id)
    if settings.permute_labels:
        y = label_permutation(num_classes, settings.seed, partition_id)[y]
    if not data_dir:
        x = feature_shift(x, settings.feature_shift, settings.feature_shift_groups,
                          partition_id)
    return {"x_train": x[train], "y_train": y[train], "x_test": x[test], "y_test": y[test]}
