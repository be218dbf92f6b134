"""MNIST-layout IDX files: the parser, local copies of mnist/fashion-mnist, ``data-root``.

Every fixture is a real IDX file written here (plain or gzipped); nothing is mocked. The
search-order tests point ``HOME`` and ``$PFLOWER_DATA_ROOT`` at temporary folders."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import datasets
import numpy as np
import pytest

from common.config import RunSettings
from fldata import (
    dataset_shape,
    default_model,
    is_local_path,
    load_client_data,
)
from fldata.idx import SPLITS, IdxError, holds_idx, read_idx, read_idx_split
from fldata.sources import arrays_from_hf, idx_pool
from tests.conftest import app_config

TYPE_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
              np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D,
              np.dtype(np.float64): 0x0E}


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of ``array``, written out by hand: 0, 0, type code, dims, sizes, data
    (all big-endian)."""
    header = struct.pack(">BBBB", 0, 0, TYPE_CODES[array.dtype], array.ndim)
    header += struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    data = idx_bytes(array)
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def fixture_arrays(n: int, side: int = 28, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, side, side), dtype=np.uint8)
    return images, rng.permutation(np.arange(n) % 10).astype(np.uint8)


def write_dataset(directory: Path, gz: bool = False, n_train: int = 200, n_test: int = 50,
                  side: int = 28, seed: int = 0) -> Path:
    """The four standard files, with ``n_train`` + ``n_test`` random 28x28 images."""
    directory.mkdir(parents=True, exist_ok=True)
    for (split, (images_name, labels_name)), n in zip(SPLITS.items(), (n_train, n_test),
                                                       strict=True):
        images, labels = fixture_arrays(n, side, seed + (split == "test"))
        write_idx(directory / images_name, images, gz)
        write_idx(directory / labels_name, labels, gz)
    return directory


def rows(x: np.ndarray) -> list[bytes]:
    """The examples of ``x`` as a sorted list, to compare sets of examples in any order."""
    return sorted(row.tobytes() for row in x)


# ---------------------------------------------------------------- the parser

@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
@pytest.mark.parametrize("array", [
    np.arange(60, dtype=np.uint8).reshape(3, 4, 5),
    np.arange(7, dtype=np.uint8),
    np.array([-3, 0, 5], dtype=np.int8),
    np.array([[-300, 2], [7, 32000]], dtype=np.int16),
    np.array([-70000, 1, 2**30], dtype=np.int32),
    np.array([[0.5, -1.25]], dtype=np.float32),
    np.array([1e-300, np.pi], dtype=np.float64),
], ids=lambda a: f"{a.dtype}-{a.ndim}d")
def test_read_idx_round_trips(tmp_path, array, gz):
    path = write_idx(tmp_path / "a-idx", array, gz)
    read = read_idx(path)
    assert read.dtype == array.dtype and read.dtype.isnative
    np.testing.assert_array_equal(read, array)
    assert read.flags.writeable


def test_gzip_is_recognised_by_content_too(tmp_path):
    """A gzipped file without the .gz suffix (some mirrors strip it) still reads."""
    array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(gzip.compress(idx_bytes(array)))
    np.testing.assert_array_equal(read_idx(path), array)


IMAGES = np.arange(2 * 4 * 4, dtype=np.uint8).reshape(2, 4, 4)  # 16 header bytes + 32
CORRUPT = {
    "cut-data": idx_bytes(IMAGES)[:-5],
    "cut-header": idx_bytes(IMAGES)[:9],
    "trailing": idx_bytes(IMAGES) + b"\0",
    "empty": b"",
    "magic": b"\x01\x00" + idx_bytes(IMAGES)[2:],
    "type": b"\0\0\x07\x03" + idx_bytes(IMAGES)[4:],
    "zero-dims": b"\0\0\x08\x00",
    "cut.gz": gzip.compress(idx_bytes(IMAGES))[:-12],
    "garbage.gz": b"\x1f\x8bnot really gzip",
}


@pytest.mark.parametrize(("name", "message"), [
    ("cut-data", "truncated: 43 bytes, the header (2x4x4 of uint8) says 48"),
    ("cut-header", "truncated IDX header (9 bytes, 3 dimensions need 16)"),
    ("trailing", "has trailing bytes: 49 bytes, the header (2x4x4 of uint8) says 48"),
    ("empty", "not an IDX file (magic missing"),
    ("magic", "not an IDX file (magic 01000803"),
    ("type", "unknown IDX type code 0x07"),
    ("zero-dims", "IDX header gives 0 dimensions"),
    ("cut.gz", "not a readable gzip file"),
    ("garbage.gz", "not a readable gzip file"),
])
def test_corrupt_file_is_one_line_naming_it(tmp_path, name, message):
    path = tmp_path / f"train-images-idx3-ubyte-{name}"
    path.write_bytes(CORRUPT[name])
    with pytest.raises(IdxError) as error:
        read_idx(path)
    text = str(error.value)
    assert text.startswith(f"{path}: ") and message in text, text
    assert "\n" not in text


def test_labels_that_do_not_match_the_images_name_the_labels_file(tmp_path):
    directory = write_dataset(tmp_path / "d")
    write_idx(directory / "train-labels-idx1-ubyte", np.zeros(199, dtype=np.uint8))
    with pytest.raises(IdxError, match=r"train-labels-idx1-ubyte: expected 200 labels"):
        read_idx_split(directory)
    write_idx(directory / "train-images-idx3-ubyte", np.zeros((200, 784), dtype=np.uint8))
    with pytest.raises(IdxError, match=r"train-images-idx3-ubyte: expected images \(N, H, W\)"):
        read_idx_split(directory)


# ---------------------------------------------------------------- the pool

@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_pool_is_the_train_split_normalised_like_the_hub(tmp_path, gz):
    """Same values, shape and dtypes as ``arrays_from_hf`` gives for the same images as a
    hub dataset (PIL images in an ``Image`` column), which is what the hub path returns."""
    directory = write_dataset(tmp_path / "d", gz)
    x, y = idx_pool(directory)
    images, labels = fixture_arrays(200)
    hub = datasets.Dataset.from_dict(
        {"image": list(images), "label": labels.tolist()},
        features=datasets.Features(image=datasets.Image(),
                                   label=datasets.ClassLabel(num_classes=10)))
    hub_x, hub_y = arrays_from_hf(hub)
    assert x.shape == (200, 1, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, hub_x)
    np.testing.assert_array_equal(y, hub_y)
    assert x.min() == -1.0 and x.max() == 1.0


def test_a_directory_of_idx_files_is_a_local_dataset(tmp_path):
    directory = write_dataset(tmp_path / "my-idx", gz=True)
    assert is_local_path(str(directory)) and holds_idx(directory)
    settings = RunSettings.from_run_config(app_config(dataset=str(directory)))
    assert dataset_shape(settings) == ((1, 28, 28), 10)
    assert default_model(settings) == "cnn"
    x_pool, _ = idx_pool(directory)
    seen = []
    for pid in range(4):
        data = load_client_data(settings, pid, 4)
        assert data.x_train.shape[1:] == (1, 28, 28) and len(data.x_test) > 0
        seen += rows(data.x_train) + rows(data.x_test)
    assert sorted(seen) == rows(x_pool), "the clients' examples are not the train split"
