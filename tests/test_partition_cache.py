"""A site's split is computed once and memory-mapped after; a change of data or partition
settings never reuses a cached split. Where it is written, and what pruning removes, is the
site's choice: the run config may only turn the cache off (issue #89)."""

from __future__ import annotations

from pathlib import Path

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

    a, b, c = key_of("a"), key_of("b"), key_of("c")
    for key in (a, b, c):
        cached_split(tmp_path, key, lambda k=key: split(ord(k[0])))
    for age, key in enumerate((b, a, c)):  # last used: b, then a, then c
        os.utime(tmp_path / key / "complete", (1000 + age, 1000 + age))
    assert cached_split(tmp_path, b, lambda: pytest.fail("b is stored"))["x_train"][0] == 98
    prune(tmp_path, 70_000, keep=tmp_path / c)  # room for two splits of 32,000 bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == [b, c]  # a: unused the longest
    prune(tmp_path, 0, keep=tmp_path / c)
    assert [p.name for p in tmp_path.iterdir()] == [c]  # the one kept stays


def key_of(letter: str) -> str:
    """A name like a cache key's (32 hex digits)."""
    return letter * 32


def _fake_split(directory: Path, key: str) -> Path:
    """A folder that looks like a stored split: ``key/`` with its arrays and ``complete``."""
    (directory / key).mkdir(parents=True)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        np.save(directory / key / f"{name}.npy", np.zeros(1000))
    (directory / key / "complete").touch()
    return directory / key


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size if p.is_file() else -1
            for p in sorted(root.rglob("*"))}


def test_pruning_removes_only_splits_it_stored_inside_its_directory(tmp_path):
    """A site may point its cache at a folder holding other things: pruning removes only
    children named like a key (not links) holding ``complete``, never through a link."""
    from fldata.cache import cached_split, prune

    cache, outside = tmp_path / "cache", tmp_path / "outside"
    stored = _fake_split(cache, key_of("a"))
    other = _fake_split(cache, "results")  # holds a complete file, but is no split of ours
    (cache / ".tmp-half-written").mkdir()
    (cache / ".tmp-half-written" / "complete").touch()
    target = _fake_split(outside, key_of("b"))
    (cache / key_of("c")).symlink_to(target, target_is_directory=True)
    prune(cache, 0)
    assert not stored.exists()
    assert other.is_dir() and (cache / ".tmp-half-written" / "complete").exists()
    assert (cache / key_of("c")).is_symlink() and sorted(p.name for p in target.iterdir()) == [
        "complete", "x_test.npy", "x_train.npy", "y_test.npy", "y_train.npy"]
    with pytest.raises(ValueError, match="not a cache key"):  # a split stays a child
        cached_split(cache, "../outside", lambda: pytest.fail("never computed"))


@pytest.mark.parametrize("value", ["/tmp/elsewhere", "../..", "partitions", "~/cache", " "])
def test_a_run_config_may_not_say_where_a_site_writes(value):
    """``data-cache`` in the run config (the server operator's) takes '' or 'off' only; a
    path is refused with one line saying the site sets it, at the run's start as at a
    site."""
    from common.config import ConfigError
    from fldata.cache import site_cache_dir

    with pytest.raises(ConfigError) as error:
        load_settings(app_config(**{"data-cache": value}))
    message = str(error.value)
    assert message.startswith("data-cache: ") and "\n" not in message
    assert "node config" in message and "--node-config" in message
    with pytest.raises(ConfigError):  # whoever builds the settings some other way
        site_cache_dir(value, None, "/site/state")


def test_where_a_site_keeps_its_cache_is_the_site_s(tmp_path, monkeypatch):
    """Node config ``data-cache`` (an absolute folder, or 'off'), else ``<state-dir>/
    partitions``, else the user's cache; the run config's 'off' turns it off too."""
    from common.config import ConfigError
    from fldata.cache import site_cache_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    state = str(tmp_path / "state")
    assert site_cache_dir("", None, None) == tmp_path / "xdg" / "pflower" / "partitions"
    assert site_cache_dir("", None, state) == tmp_path / "state" / "partitions"
    assert site_cache_dir("", str(tmp_path / "site"), state) == tmp_path / "site"
    assert site_cache_dir("", "off", state) is None  # the site turns it off
    assert site_cache_dir("off", str(tmp_path / "site"), state) is None  # or the run does
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert site_cache_dir("", "~/cache", state) == tmp_path / "home" / "cache"
    with pytest.raises(ConfigError, match="node config: data-cache 'cache' must be an "
                                          "absolute directory or 'off'"):
        site_cache_dir("", "cache", state)


def test_a_client_writes_and_prunes_only_under_its_site_s_cache(tmp_path, monkeypatch):
    """The ClientApp's own path (``Client.from_context``, ``Client.data``): a run config
    naming a folder elsewhere (``/abs``, ``../..``) writes nothing and prunes nothing
    anywhere (the client refuses it); with the default run config the split goes under
    the site's state dir (or the node config's ``data-cache``) and pruning there leaves every
    other folder as it was."""
    import fldata.cache
    from common.config import ConfigError
    from tests.conftest import make_client

    work = tmp_path / "a" / "b"  # ../.. from here is tmp_path
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(fldata.cache, "MAX_CACHE_BYTES", 0)  # every new split prunes
    elsewhere = tmp_path / "elsewhere"
    _fake_split(elsewhere, key_of("e"))
    _fake_split(tmp_path, key_of("f"))  # what ../.. would prune
    state = tmp_path / "state"
    old = _fake_split(state / "partitions", key_of("0"))  # the site's own old split
    old_paths = {str(p.relative_to(tmp_path)) for p in (old, *old.iterdir())}
    before = _tree(tmp_path)
    for value in (str(elsewhere), "../..", "elsewhere"):
        with pytest.raises(ConfigError, match="data-cache: "):
            make_client(0, app_config(**{"data-cache": value}), **{"state-dir": str(state)})
    assert _tree(tmp_path) == before  # nothing written, nothing removed

    make_client(0, app_config(), **{"state-dir": str(state)}).data()
    after = _tree(tmp_path)
    new = set(after) - set(before)
    removed = set(before) - set(after)
    assert new and all(p.startswith("state/partitions/") for p in new), new
    assert removed == old_paths  # pruned: the site's own old split, nothing else
    assert {k: v for k, v in after.items() if not k.startswith("state/")} == {
        k: v for k, v in before.items() if not k.startswith("state/")}

    site_cache = tmp_path / "site-cache"  # the node config's data-cache, beside state-dir
    make_client(1, app_config(), **{"state-dir": str(state), "data-cache": str(site_cache)}
                ).data()
    assert [p.name for p in site_cache.iterdir()] and _tree(state) == {
        k.removeprefix("state/"): v for k, v in after.items() if k.startswith("state/")}
    assert not (tmp_path / "xdg").exists()


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
