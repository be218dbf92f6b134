"""Where examples come from: bundled, generated, Hugging Face hub, or local files (anything
``datasets.load_dataset`` opens: a folder of images, a parquet, csv or json file).

Every source yields a pool ``(x, y)``: ``x`` float32 of shape ``(N, *input_shape)``, ``y``
int64 class ids. Images are scaled to [0, 1] and normalised per channel (mean 0.5, std 0.5).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the Hugging Face datasets library loads in seconds: only where it is used
    import datasets

from common.config import ConfigError
from fldata.idx import holds_idx, read_idx_split


@dataclass(frozen=True)
class SyntheticFedFac:
    """One client's data from a FedFac-style teacher-student generator.

    It follows the idea of the FedFac paper's simulation (a one-hidden-layer teacher of which
    some hidden units are common to all clients) but is **not** the paper's generator (its
    eq. 8). Where it departs: Gaussian draws where the paper's are uniform,
    client-specific output weights where the paper fixes them, personal weights not drawn
    around the client mean, labels split at the median. Exactly what it draws, for client
    ``c`` with ``d = dim``, ``m = hidden``:

    - covariates ``x = [x_p, x_s]``: ``d - d_s`` personal ones ``x_p ~ N(mu_c, Sigma)``,
      ``Sigma_ij = 0.5^|i-j|``, ``mu_c ~ N(0, I)`` per client, and ``d_s = round(alpha * d)``
      shared ones ``x_s ~ N(0, I)`` (``alpha`` = ``shared_covariate_fraction``);
    - teacher: hidden units ``j < m2 = round(p * m)`` (``p`` = ``shared_param_fraction``) take
      input weights ``w1_j ~ N(0, I/d)`` and output weight ``w2_j ~ N(0, 1/m)`` drawn once for
      all clients; the other ``m - m2`` units take input and output weights from the same
      distributions, drawn independently for each client;
    - ``f = relu(x w1^T) w2``, centred at the client's median and divided by its standard
      deviation, ``y = 1[4 f + noise * e > 0]`` with ``e ~ N(0, 1)``: about half of each
      client's labels are 1.
    """

    dim: int
    hidden: int
    shared_param_fraction: float
    shared_covariate_fraction: float
    noise: float

    @property
    def num_shared_units(self) -> int:
        return round(self.shared_param_fraction * self.hidden)

    @property
    def num_shared_covariates(self) -> int:
        return round(self.shared_covariate_fraction * self.dim)

    def true_shared_units(self) -> np.ndarray:
        """Boolean mask over hidden units: True for the teacher's shared units (the first
        ``m2``). A student with ``hidden`` units given this split is the oracle FedFac is
        compared with."""
        return np.arange(self.hidden) < self.num_shared_units

    def _teacher(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        w1 = rng.normal(0, 1 / np.sqrt(self.dim), (self.hidden, self.dim))
        w2 = rng.normal(0, 1 / np.sqrt(self.hidden), self.hidden)
        return w1, w2

    def client(self, seed: int, client: int, num_samples: int) -> tuple[np.ndarray, np.ndarray]:
        shared_w1, shared_w2 = self._teacher(np.random.default_rng([seed, 0]))
        rng = np.random.default_rng([seed, 1, client])
        own_w1, own_w2 = self._teacher(rng)
        shared = self.true_shared_units()
        w1 = np.where(shared[:, None], shared_w1, own_w1)
        w2 = np.where(shared, shared_w2, own_w2)

        d_p = self.dim - self.num_shared_covariates
        idx = np.arange(d_p)
        sigma = 0.5 ** np.abs(idx[:, None] - idx[None, :])
        mu = rng.normal(0, 1, d_p)
        x_p = rng.multivariate_normal(mu, sigma, num_samples) if d_p else np.empty((num_samples, 0))
        x_s = rng.normal(0, 1, (num_samples, self.num_shared_covariates))
        x = np.concatenate([x_p, x_s], axis=1)

        f = np.maximum(x @ w1.T, 0) @ w2
        f = (f - np.median(f)) / (f.std() + 1e-12)
        logit = 4 * f + self.noise * rng.normal(0, 1, num_samples)
        y = (1 / (1 + np.exp(-logit)) > 0.5).astype(np.int64)
        return x.astype(np.float32), y


@lru_cache(maxsize=1)
def digits_pool() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes), as (N, 1, 8, 8)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0 - 0.5) / 0.5
    return x[:, None], bunch.target.astype(np.int64)


def hub_unreachable(hub_id: str, timeout: float = 5.0) -> str | None:
    """Why the Hugging Face Hub cannot give this machine ``hub_id`` now (offline mode set, or
    its host does not answer within ``timeout`` seconds), or None: reachable, a copy is in
    the local cache, or ``hub_id`` is a local folder in the hub's layout. Checked before
    loading: ``datasets`` retries an unreachable hub for about 25 s before it fails."""
    import socket
    from urllib.parse import urlparse

    from datasets import config
    from huggingface_hub import constants

    if (Path(hub_id).exists()
            or (Path(constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}").exists()
            or (Path(config.HF_DATASETS_CACHE) / hub_id.replace("/", "___")).exists()):
        return None
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set and no copy is in the local cache"
    endpoint = urlparse(constants.ENDPOINT)
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
    except OSError as error:
        return f"{endpoint.hostname}:{port} is unreachable ({error.strerror or error})"
    return None


def _image_column(ds: datasets.Dataset, image_column: str = "") -> str:
    import datasets

    if image_column:
        if image_column not in ds.column_names:
            raise ConfigError(f"image-column: no column {image_column!r}; the dataset has "
                             f"{', '.join(ds.column_names)}")
        return image_column
    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            return name
    for name in ("image", "img", "x"):
        if name in ds.column_names:
            return name
    raise ConfigError(f"image-column: no image column found among {', '.join(ds.column_names)};"
                     " name it with image-column")


def _image_arrays(ds: datasets.Dataset, column: str) -> np.ndarray:
    """The column's images as one array: decoded image files (a grey set stays grey, any
    colour makes all RGB) or pixel values stored as nested lists."""
    import datasets

    feature = ds.features[column]
    if isinstance(feature, dict) and "bytes" in feature:  # encoded images without metadata
        ds, feature = ds.cast_column(column, datasets.Image()), datasets.Image()
    if not isinstance(feature, datasets.Image):
        return ds.with_format("numpy")[column]
    images = ds[column]
    mode = "L" if all(im.mode == "L" for im in images) else "RGB"
    sizes = {im.size for im in images}
    if len(sizes) > 1:
        raise ConfigError(f"image-column: the images have {len(sizes)} different sizes "
                         f"({', '.join(f'{w}x{h}' for w, h in sorted(sizes)[:3])}, ...); "
                         "resize them to one size first")
    return np.stack([np.asarray(im.convert(mode)) for im in images])


def arrays_from_hf(ds: datasets.Dataset, label_column: str = "label",
                   image_column: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Images (image files, or pixels as nested lists) and labels of a ``datasets.Dataset``
    as (x, y) arrays; ``image_column`` empty: the first Image column, else ``image``, ``img``
    or ``x``. Labels that are not class ids (strings, say) become ids in sorted order.

    Grey images become (N, 1, H, W), colour ones (N, 3, H, W), normalised as above.
    """
    column = _image_column(ds, image_column)
    if label_column not in ds.column_names:
        raise ConfigError(f"label-column: no column {label_column!r}; the dataset has "
                         f"{', '.join(ds.column_names)}")
    labels = np.asarray(ds[label_column])
    if not np.issubdtype(labels.dtype, np.integer):
        labels = np.unique(labels, return_inverse=True)[1]
    return normalise_images(_image_arrays(ds, column)), labels.astype(np.int64)


def normalise_images(images: np.ndarray) -> np.ndarray:
    """Grey (N, H, W) or colour (N, H, W, C) pixels, in [0, 255] or [0, 1], as float32
    (N, C, H, W) normalised as above. Every image source goes through here, so a dataset
    read from local files matches the same dataset from the hub value for value."""
    x = np.array(images, dtype=np.float32)  # a copy of our own: the steps below work in place
    if x.max() > 1.0:
        x /= 255.0
    x -= 0.5
    x /= 0.5
    return x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)


def idx_pool(directory: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The train split of a directory of IDX files (MNIST layout), as (x, y) normalised like
    the hub's copy of the same dataset: the hub path partitions the train split only."""
    images, labels = read_idx_split(directory, "train")
    return normalise_images(images), labels.astype(np.int64)


def _saved_by_datasets(path: Path) -> bool:
    """A directory written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


# local files that ``datasets.load_dataset`` reads, by suffix: the builder that reads them
DATA_FILES = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def _holds_images(path: Path) -> bool:
    return any(p.suffix.lower() in IMAGE_SUFFIXES for p in path.rglob("*"))


def resolve_local(path: str | Path) -> Path:
    """The dataset a local path means: the path itself when it is a file, a saved
    ``datasets`` directory or a folder of IDX files, else the one ``.npz`` or saved dataset
    inside the directory (a site's mounted data folder holding ``train.npz``, say), else the
    directory itself when it holds images (an image folder)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset: no such file or directory: {path}")
    if not path.is_dir() or _saved_by_datasets(path) or holds_idx(path):
        return path
    found = sorted(p for p in path.iterdir() if not p.name.startswith(".") and (
        (p.suffix == ".npz" and p.is_file()) or (p.is_dir() and _saved_by_datasets(p))))
    if not found and _holds_images(path):
        return path
    if len(found) != 1:
        raise FileNotFoundError(
            f"dataset: {path} holds {len(found)} datasets ({', '.join(p.name for p in found)})"
            "; it must be an image folder, an .npz or a datasets.save_to_disk folder, or hold "
            "exactly one .npz or saved dataset")
    return found[0]


def load_column(path: str | Path, column: str) -> np.ndarray:
    """One column of a local dataset of the ``datasets`` kinds (a parquet, csv or json file,
    a saved dataset): what the natural partitioner splits by."""
    path = resolve_local(path)
    if path.suffix == ".npz" or holds_idx(path) or not (
            (path.is_file() and path.suffix.lower() in DATA_FILES) or _saved_by_datasets(path)):
        raise ConfigError(f"partitioner: 'natural' needs a dataset with columns (a parquet, "
                          f"csv or json file, or a saved dataset); {path.name} has none")
    with _no_progress_bars():
        loaded = _open_dataset(path)
    if column not in loaded.column_names:
        raise ConfigError(f"partition-column: no column {column!r}; the dataset has "
                          f"{', '.join(loaded.column_names)}")
    return np.asarray(loaded[column])


def load_local(path: str | Path, label_column: str = "label",
               image_column: str = "") -> tuple[np.ndarray, np.ndarray]:
    """A dataset on local disk, for air-gapped devices.

    One of: a ``.npz`` file with arrays ``x`` (N, C, H, W) or (N, D) and ``y`` (N,); a
    directory holding the four MNIST-layout IDX files (the train split is used, see
    ``idx_pool``); a file ``datasets.load_dataset`` reads (``DATA_FILES``: parquet, csv,
    json); a directory written by ``datasets.Dataset.save_to_disk`` (a ``DatasetDict``'s
    ``train`` split is used); a folder of images, one subfolder per class (or with a
    ``metadata.csv``, as ``datasets``' image folders); or a directory holding exactly one
    ``.npz`` or saved dataset (see ``resolve_local``). ``label_column`` and ``image_column``
    name the columns of the ``datasets`` kinds (``arrays_from_hf``).
    """
    path = resolve_local(path)
    if path.suffix == ".npz":
        with np.load(path) as data:
            return data["x"].astype(np.float32), data["y"].astype(np.int64)
    if holds_idx(path):
        return idx_pool(path)
    if path.is_file() and path.suffix.lower() not in DATA_FILES:
        raise ConfigError(f"dataset: cannot read {path.name}; a local file must be .npz or "
                          f"{', '.join(DATA_FILES)}")
    with _no_progress_bars():
        return arrays_from_hf(_open_dataset(path), label_column, image_column)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """``datasets``' progress bars off while it reads local files: its builders call copying
    a local file "Downloading data" and show it, and "Generating train split", for a folder
    of images read in a second. Its warnings and errors still show (its logging is left as
    it is); ``HF_DATASETS_DISABLE_PROGRESS_BARS=0``, a user's wish for the bars, is kept."""
    from datasets import config
    from datasets.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    if are_progress_bars_disabled() or config.HF_DATASETS_DISABLE_PROGRESS_BARS is False:
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


def _open_dataset(path: Path) -> datasets.Dataset:
    """A local dataset ``datasets`` opens: a ``DATA_FILES`` file, a saved dataset, else an
    image folder; a ``DatasetDict``'s train split."""
    import datasets

    if path.is_file():
        loaded = datasets.load_dataset(DATA_FILES[path.suffix.lower()],
                                       data_files=str(path), split="train")
    elif _saved_by_datasets(path):
        loaded = datasets.load_from_disk(str(path))
    else:
        check_class_folders(path)
        loaded = datasets.load_dataset("imagefolder", data_dir=str(path), split="train")
    return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded


def check_class_folders(path: Path) -> None:
    """An image folder without a metadata file takes its labels from its sub-folders, one a
    class: with fewer than two, ``datasets`` makes no label column at all, and the run would
    fail later on a missing ``label`` column. Refused here, saying so."""
    if any(path.glob("metadata.*")):
        return
    classes = sorted(p.name for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(classes) < 2:
        held = f"one ({classes[0]!r})" if classes else "none"
        raise ConfigError(f"dataset: the image folder {path} has {held} of the class folders "
                          "that give its labels; put each class's images in a sub-folder of "
                          "its own, at least two (or add a metadata.csv with a label column)")
