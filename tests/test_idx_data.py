"""MNIST-layout IDX files: the parser, local copies of mnist/fashion-mnist, ``data-root``.

Every fixture is a real IDX file written here (plain or gzipped); nothing is mocked. The
search-order tests point ``HOME`` and ``$PFLOWER_DATA_ROOT`` at temporary folders."""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import datasets
import numpy as np
import pytest

import fldata
from bench.data import ensure_dataset
from common.config import ConfigError, RunSettings
from fldata import (
    DATASETS,
    DatasetInfo,
    _hub_partition,
    dataset_shape,
    default_model,
    is_local_path,
    load_client_data,
    local_copy,
)
from fldata.idx import ENV_ROOT, SPLITS, IdxError, holds_idx, read_idx, read_idx_split, search_dirs
from fldata.partition import partition_indices
from fldata.sources import arrays_from_hf, idx_pool
from tests.conftest import app_config

TYPE_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
              np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D,
              np.dtype(np.float64): 0x0E}
SYSTEM_DIR = Path(DATASETS["fashion-mnist"].system_dir)


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


@pytest.fixture
def isolated_search(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty home (so ``~/.cache/pflower`` is empty) and no ``$PFLOWER_DATA_ROOT``."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(ENV_ROOT, raising=False)
    return home


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


# ---------------------------------------------------------------- where copies are found

def test_search_order(isolated_search, tmp_path, monkeypatch):
    env_root = tmp_path / "env"
    monkeypatch.setenv(ENV_ROOT, str(env_root))
    cache = isolated_search / ".cache" / "pflower"
    assert search_dirs("fashion-mnist", "", str(SYSTEM_DIR)) == [
        env_root / "fashion-mnist", cache / "fashion-mnist", SYSTEM_DIR]
    assert search_dirs("mnist") == [env_root / "mnist", cache / "mnist"]
    assert search_dirs("mnist", str(tmp_path / "r")) == [tmp_path / "r" / "mnist",
                                                         tmp_path / "r"]

    def found(**overrides) -> Path | None:
        return local_copy(RunSettings.from_run_config(app_config(**overrides)))

    # nothing in the environment's root or the cache: mnist comes from the hub, and
    # fashion-mnist from the Debian package where it is installed
    assert found(dataset="mnist") is None
    assert found(dataset="fashion-mnist") == (SYSTEM_DIR if holds_idx(SYSTEM_DIR) else None)
    write_dataset(cache / "fashion-mnist")
    write_dataset(cache / "mnist")
    assert found(dataset="fashion-mnist") == cache / "fashion-mnist"  # before the package
    assert found(dataset="mnist") == cache / "mnist"
    write_dataset(env_root / "fashion-mnist", gz=True)
    assert found(dataset="fashion-mnist") == env_root / "fashion-mnist"  # before the cache
    assert found(dataset="mnist") == cache / "mnist"
    # data-root: <data-root>/<dataset> first, then the folder itself; the rest is not searched
    explicit = write_dataset(tmp_path / "explicit")
    assert found(dataset="fashion-mnist", **{"data-root": str(explicit)}) == explicit
    write_dataset(explicit / "fashion-mnist")
    assert found(dataset="fashion-mnist",
                 **{"data-root": str(explicit)}) == explicit / "fashion-mnist"
    # three files of four are not a copy
    (env_root / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz").unlink()
    assert found(dataset="fashion-mnist") == cache / "fashion-mnist"


def test_a_cached_split_follows_where_the_pool_is_read_from(isolated_search, tmp_path,
                                                           monkeypatch):
    """mnist without ``data-root`` is read from the first copy found: a copy that appears in
    ``$PFLOWER_DATA_ROOT`` later is another pool, and a site's cached split of the first one
    is not handed back for it."""
    write_dataset(isolated_search / ".cache" / "pflower" / "mnist", seed=0)
    settings = RunSettings.from_run_config(app_config(dataset="mnist", partitioner="iid"))
    partitions = tmp_path / "partitions"
    before = load_client_data(settings, 0, 2, cache_dir=partitions)
    monkeypatch.setenv(ENV_ROOT, str(tmp_path / "env"))
    write_dataset(tmp_path / "env" / "mnist", seed=5)
    after = load_client_data(settings, 0, 2, cache_dir=partitions)
    assert rows(after.x_train) == rows(load_client_data(settings, 0, 2).x_train)
    assert rows(after.x_train) != rows(before.x_train)


def test_a_split_is_cut_from_the_pool_its_cache_key_names(isolated_search, tmp_path,
                                                          monkeypatch):
    """Where the pool is read from is looked up once a load: a copy that appears in
    ``$PFLOWER_DATA_ROOT`` while a split is computed is not what gets stored under the key
    of the copy found before it."""
    write_dataset(isolated_search / ".cache" / "pflower" / "mnist", seed=0)
    settings = RunSettings.from_run_config(app_config(dataset="mnist", partitioner="iid"))
    looked_up = fldata.pool_source

    def a_copy_appears(run: RunSettings) -> str | None:
        found = looked_up(run)
        monkeypatch.setenv(ENV_ROOT, str(tmp_path / "env"))
        write_dataset(tmp_path / "env" / "mnist", seed=5)
        return found

    monkeypatch.setattr(fldata, "pool_source", a_copy_appears)
    cached = load_client_data(settings, 0, 2, cache_dir=tmp_path / "partitions")
    monkeypatch.setattr(fldata, "pool_source", looked_up)
    monkeypatch.delenv(ENV_ROOT)
    assert rows(cached.x_train) == rows(load_client_data(settings, 0, 2).x_train)


def test_data_root_without_the_files_stops_with_one_line(isolated_search, tmp_path):
    settings = RunSettings.from_run_config(app_config(
        dataset="fashion-mnist", **{"data-root": str(tmp_path / "nothing")}))
    with pytest.raises(ConfigError) as error:
        load_client_data(settings, 0, 2)
    text = str(error.value)
    assert text.startswith("data-root: no fashion-mnist IDX files") and "\n" not in text
    assert str(tmp_path / "nothing" / "fashion-mnist") in text


def test_data_root_is_in_the_app_config():
    config = app_config()
    assert config["data-root"] == ""
    assert RunSettings.from_run_config(config).data_root == ""


# ---------------------------------------------------------------- a run's client data

@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_fashion_mnist_with_data_root_gives_client_partitions(isolated_search, tmp_path, gz):
    root = tmp_path / "data"
    write_dataset(root / "fashion-mnist", gz, n_train=300)
    config = app_config(dataset="fashion-mnist", partitioner="dirichlet",
                        **{"data-root": str(root)})
    settings = RunSettings.from_run_config(config)
    x_pool, y_pool = idx_pool(root / "fashion-mnist")
    n, seen = 5, []
    for pid in range(n):
        data = load_client_data(settings, pid, n)
        assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
        assert data.x_train.shape[1:] == (1, 28, 28) and data.num_classes == 10
        assert len(data.y_train) > 0 and len(data.y_test) > 0
        expected = partition_indices(y_pool, settings, pid, n)
        assert rows(np.concatenate([data.x_train, data.x_test])) == rows(x_pool[expected])
        seen.append(expected)
    joined = np.concatenate(seen)
    assert len(joined) == len(np.unique(joined)) == len(y_pool)


def test_local_copy_holds_the_same_client_examples_as_the_hub_path(
        isolated_search, tmp_path, monkeypatch):
    """The same train split, once through flwr-datasets' ``FederatedDataset`` (the real hub
    code, on a local Parquet copy: no internet) and once read from IDX files: every client
    gets the same examples (flwr-datasets shuffles with ``default_rng(seed).permutation``,
    as ``partition_indices`` does)."""
    images, labels = fixture_arrays(300)
    parquet = tmp_path / "hub" / "data"
    parquet.mkdir(parents=True)
    datasets.Dataset.from_dict(
        {"image": list(images), "label": labels.tolist()},
        features=datasets.Features(image=datasets.Image(),
                                   label=datasets.ClassLabel(num_classes=10)),
    ).to_parquet(str(parquet / "train-00000.parquet"))
    write_dataset(tmp_path / "idx" / "fashion-mnist", n_train=300)
    monkeypatch.setitem(DATASETS, "fashion-mnist", DatasetInfo(
        (1, 28, 28), 10, "cnn", str(parquet.parent), idx=True))
    # datasets read HOME when imported: keep its cache of the Parquet copy out of the real one
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    for partitioner in ("dirichlet", "iid", "pathological"):
        settings = RunSettings.from_run_config(app_config(
            dataset="fashion-mnist", partitioner=partitioner,
            **{"data-root": str(tmp_path / "idx")}))
        for pid in range(4):
            hub_x, hub_y = _hub_partition(settings, pid, 4)
            local = load_client_data(settings, pid, 4)
            assert rows(hub_x) == rows(np.concatenate([local.x_train, local.x_test]))
            assert sorted(hub_y) == sorted(np.concatenate([local.y_train, local.y_test]))


def test_a_local_copy_of_the_wrong_shape_is_a_clear_error(isolated_search, tmp_path):
    root = tmp_path / "data"
    write_dataset(root / "mnist", side=8)
    settings = RunSettings.from_run_config(app_config(dataset="mnist",
                                                      **{"data-root": str(root)}))
    with pytest.raises(ConfigError, match=r"dataset: the local copy in .*/mnist holds 200 "
                                          r"examples of shape \(1, 8, 8\).*mnist has shape "
                                          r"\(1, 28, 28\)"):
        load_client_data(settings, 0, 2)


def test_corrupt_local_copy_names_the_file_when_loading(isolated_search, tmp_path):
    root = tmp_path / "data"
    directory = write_dataset(root / "fashion-mnist")
    bad = directory / "train-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:-100])
    settings = RunSettings.from_run_config(app_config(dataset="fashion-mnist",
                                                      **{"data-root": str(root)}))
    with pytest.raises(IdxError, match=f"^{bad}: truncated"):
        load_client_data(settings, 0, 2)


# ---------------------------------------------------------------- the benchmark helper

def test_bench_helper_finds_a_copy_and_says_what_to_do_without_one(isolated_search, tmp_path,
                                                                   capsys):
    root = tmp_path / "data"
    write_dataset(root / "fashion-mnist", gz=True)
    assert ensure_dataset("fashion-mnist", str(root), install=False) == root / "fashion-mnist"
    assert ensure_dataset("fashion-mnist", str(tmp_path / "none"), install=False) is None
    line = capsys.readouterr().err
    assert line.count("\n") == 1 and line.startswith("fashion-mnist: not found in ")
    assert "run: put the four IDX files" in line
    found = ensure_dataset("fashion-mnist", install=False)
    if holds_idx(SYSTEM_DIR):
        assert found == SYSTEM_DIR
    else:
        assert found is None
        assert "run: sudo apt-get install -y dataset-fashion-mnist" in capsys.readouterr().err


# ---------------------------------------------------------------- the real files

@pytest.mark.skipif(not holds_idx(SYSTEM_DIR),
                    reason=f"Debian's dataset-fashion-mnist is not installed ({SYSTEM_DIR})")
def test_debian_fashion_mnist_files():
    train_x, train_y = read_idx_split(SYSTEM_DIR, "train")
    test_x, test_y = read_idx_split(SYSTEM_DIR, "test")
    assert train_x.shape == (60_000, 28, 28) and test_x.shape == (10_000, 28, 28)
    assert len(train_x) + len(test_x) == 70_000 and train_x.dtype == np.uint8
    counts = np.bincount(np.concatenate([train_y, test_y]))
    assert counts.tolist() == [7_000] * 10
    assert os.path.basename(SYSTEM_DIR) == "fashion-mnist"
