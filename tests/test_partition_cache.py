"""A site's split is computed once and memory-mapped after; a change of data or partition
settings never reuses a cached split."""

from __future__ import annotations

import numpy as np
import pytest

from fldata import SyntheticSettings, load_client_data
from fldata.cache import DATA_KEYS
from strategies.registry import load_settings
from tests.conftest import ROOT, app_config


def _data(cache, num_partitions=5, partition=1, **overrides):
    settings = load_settings(app_config(**overrides))
    return load_client_data(settings, partition, num_partitions, cache_dir=cache)


def _same(a, b) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k))
               for k in ("x_train", "y_train", "x_test", "y_test"))


def test_second_load_maps_the_stored_split(tmp_path):
    first = _data(tmp_path)
    stored = list(tmp_path.iterdir())
    assert len(stored) == 1 and (stored[0] / "complete").exists()
    again = _data(tmp_path)
    assert isinstance(again.x_train, np.memmap)
    assert _same(first, again)
    assert _same(again, _data(None))  # what the cache holds is what computing gives
    assert list(tmp_path.iterdir()) == stored


@pytest.mark.parametrize(("changed", "num_partitions"), [
    ({"seed": 7}, 5),
    ({"dirichlet-alpha": 0.1}, 5),
    ({}, 6),
    ({"partitioner": "iid"}, 5),
    ({"test-fraction": 0.3}, 5),
    ({"validation-fraction": 0.3}, 5),
    ({"permute-labels": True}, 5),
])
def test_changed_settings_never_reuse_a_cached_split(tmp_path, changed, num_partitions):
    _data(tmp_path)
    cached = _data(tmp_path, num_partitions, **changed)
    fresh = _data(None, num_partitions, **changed)
    assert _same(cached, fresh)
    assert not _same(cached, _data(tmp_path))
    assert len(list(tmp_path.iterdir())) == 2


def test_changed_source_file_is_a_new_split(tmp_path):
    pool = tmp_path / "pool.npz"
    rng = np.random.default_rng(0)
    np.savez(pool, x=rng.normal(size=(200, 6)).astype(np.float32),
             y=rng.integers(0, 3, 200))
    cache = tmp_path / "cache"
    before = _data(cache, dataset=str(pool))
    np.savez(pool, x=rng.normal(size=(200, 6)).astype(np.float32),
             y=rng.integers(0, 3, 200))
    after = _data(cache, dataset=str(pool))
    assert _same(after, _data(None, dataset=str(pool)))
    assert not _same(before, after)


def test_a_changed_min_partition_size_is_a_new_split(tmp_path):
    # Dirichlet 0.1 over 10 clients leaves one with 19 digits: a minimum of 30 redraws
    sparse = {"partitioner": "dirichlet", "dirichlet-alpha": 0.1}
    first = _data(tmp_path, 10, **sparse)
    cached = _data(tmp_path, 10, **sparse, **{"min-partition-size": 30})
    assert _same(cached, _data(None, 10, **sparse, **{"min-partition-size": 30}))
    assert not _same(first, cached)
    assert len(list(tmp_path.iterdir())) == 2


def test_the_cache_keeps_the_splits_used_last_within_its_bound(tmp_path):
    """A new split beyond the bound removes the splits unused the longest; a split read
    again counts as used."""
    import os

    from fldata.cache import cached_split, prune

    def split(value: int) -> dict[str, np.ndarray]:
        return {name: np.full(1000, value, dtype=np.int64)  # 8,000 bytes each, 32,000 a split
                for name in ("x_train", "y_train", "x_test", "y_test")}

    for key in ("a", "b", "c"):
        cached_split(tmp_path, key, lambda k=key: split(ord(k)))
    for age, key in enumerate(("b", "a", "c")):  # last used: b, then a, then c
        os.utime(tmp_path / key / "complete", (1000 + age, 1000 + age))
    assert cached_split(tmp_path, "b", lambda: pytest.fail("b is stored"))["x_train"][0] == 98
    prune(tmp_path, 70_000, keep=tmp_path / "c")  # room for two splits of 32,000 bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c"]  # a: unused the longest
    prune(tmp_path, 0, keep=tmp_path / "c")
    assert [p.name for p in tmp_path.iterdir()] == ["c"]  # the one kept stays


def test_another_label_column_of_the_same_dataset_is_a_new_split(tmp_path):
    """Picking another label column of the same local dataset (the first pick wrong) must not
    hand back the split cached with the first one's labels."""
    import datasets

    rng = np.random.default_rng(0)
    images = list((rng.random((200, 8, 8)) * 255).astype(np.uint8))
    labels = rng.integers(0, 10, 200)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"image": images, "label": labels.tolist(),
                                "coarse": (labels // 5).tolist()}).save_to_disk(str(saved))
    cache = tmp_path / "cache"
    fine = _data(cache, dataset=str(saved), partitioner="iid")
    coarse = _data(cache, dataset=str(saved), partitioner="iid", **{"label-column": "coarse"})
    assert _same(coarse, _data(None, dataset=str(saved), partitioner="iid",
                               **{"label-column": "coarse"}))
    assert not _same(fine, coarse)


def test_every_setting_the_data_code_reads_is_in_the_cache_key():
    """A setting the split depends on but the key leaves out gives back a stale split once it
    changes (``label-column`` and ``image-column`` once were left out). ``model`` is read only
    to name the default backbone."""
    import dataclasses
    import re

    from common.config import RunSettings

    key_of = {f.name: f.metadata["key"] for f in dataclasses.fields(RunSettings)
              if "key" in f.metadata}
    read = {attribute for path in (ROOT / "fldata").rglob("*.py")
            for attribute in re.findall(r"settings\.(\w+)", path.read_text())}
    assert read - set(key_of) == {"raw"}  # a new kind of read must be looked at here
    assert {key_of[a] for a in read if a in key_of} - {"model"} <= set(DATA_KEYS)
    # what the data code reads through ``raw``: the synthetic keys, hashed by their prefix
    synthetic_keys = SyntheticSettings.keys()
    assert synthetic_keys and all(k.startswith("synthetic.") for k in synthetic_keys)
