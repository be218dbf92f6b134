"""feature-shift: client groups see the same examples, their images turned by a fixed
rotation per group; the cache tells shifted splits apart; what the shift cannot serve stops
the run at start with one line."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import ConfigError
from fldata import ClientData, load_client_data
from fldata.cache import cache_key
from fldata.partition import feature_shift
from strategies.registry import load_settings
from tests.conftest import app_config

CLIENTS = 8


def _data(partition: int, cache=None, data_dir=None, **overrides) -> ClientData:
    settings = load_settings(app_config(dataset="digits", **overrides))
    return load_client_data(settings, partition, CLIENTS, data_dir=data_dir, cache_dir=cache)


def _rotate(overrides: dict, groups: int) -> dict:
    return {**overrides, "feature-shift": "rotate", "feature-shift-groups": groups}


def _same(a: ClientData, b: ClientData) -> bool:
    return all(np.array_equal(getattr(a, k), getattr(b, k))
               for k in ("x_train", "y_train", "x_test", "y_test"))


@pytest.mark.parametrize("groups", [1, 2, 3, 4])
@pytest.mark.parametrize("partition", [{"partitioner": "iid"},
                                       {"partitioner": "dirichlet", "dirichlet-alpha": 0.5}])
def test_a_client_gets_its_own_images_turned_by_its_group(partition, groups):
    for pid in range(CLIENTS):
        plain, shifted = _data(pid, **partition), _data(pid, **_rotate(partition, groups))
        group = pid % groups
        for split in ("train", "test"):
            x, x_shifted = getattr(plain, f"x_{split}"), getattr(shifted, f"x_{split}")
            # the same examples in the same order: labels untouched, images turned exactly
            np.testing.assert_array_equal(getattr(plain, f"y_{split}"),
                                          getattr(shifted, f"y_{split}"))
            np.testing.assert_array_equal(x_shifted, np.rot90(x, group, axes=(-2, -1)))
            assert x_shifted.shape == x.shape and x_shifted.dtype == x.dtype
            # digits are not symmetric under a turn: a group other than 0 sees other inputs
            assert np.array_equal(x_shifted, x) == (group == 0), (pid, split)


def test_groups_cycle_with_the_partition_id():
    first = {pid: _data(pid, **_rotate({"partitioner": "iid"}, 4)) for pid in range(CLIENTS)}
    for pid in range(4):
        plain, again = _data(pid + 4, partitioner="iid"), first[pid + 4]
        # client pid + 4 is in client pid's group: turned by the same angle
        np.testing.assert_array_equal(again.x_train, np.rot90(plain.x_train, pid, axes=(-2, -1)))
    turns = {pid: next(k for k in range(4) if np.array_equal(
        first[pid].x_test, np.rot90(_data(pid, partitioner="iid").x_test, k, axes=(-2, -1))))
        for pid in range(CLIENTS)}
    assert turns == {pid: pid % 4 for pid in range(CLIENTS)}


def test_a_shifted_split_is_never_a_cached_unshifted_one(tmp_path):
    _data(1, tmp_path, partitioner="iid")
    cached = _data(1, tmp_path, **_rotate({"partitioner": "iid"}, 4))
    assert _same(cached, _data(1, **_rotate({"partitioner": "iid"}, 4)))
    assert not _same(cached, _data(1, tmp_path, partitioner="iid"))
    # 2 groups put client 1 in group 1 too, but it is another setting: a split of its own
    _data(1, tmp_path, **_rotate({"partitioner": "iid"}, 2))
    assert len(list(tmp_path.iterdir())) == 3


@pytest.mark.parametrize("changed", [{"feature-shift": "rotate"},
                                     {"feature-shift-groups": 2}])
def test_the_cache_key_holds_both_keys(changed):
    raw = app_config(dataset="digits")
    assert cache_key(raw, 1, CLIENTS, []) != cache_key({**raw, **changed}, 1, CLIENTS, [])


def test_a_sites_own_data_is_not_shifted(tmp_path):
    x = np.random.default_rng(0).normal(size=(40, 1, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "site.npz", x=x, y=np.arange(40) % 4)
    plain = _data(1, data_dir=str(tmp_path / "site.npz"))
    shifted = _data(1, data_dir=str(tmp_path / "site.npz"), **_rotate({}, 4))
    assert _same(plain, shifted)
    assert {tuple(row.ravel()) for row in shifted.x_train} <= {tuple(row.ravel()) for row in x}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"feature-shift": "flip"}, "feature-shift: unknown value 'flip'; allowed: none, rotate"),
    ({"feature-shift": True}, "feature-shift: expected str, got True"),
    ({"feature-shift-groups": 0}, "feature-shift-groups: 0 is out of range; allowed: [1, 4]"),
    ({"feature-shift-groups": 5}, "feature-shift-groups: 5 is out of range; allowed: [1, 4]"),
    ({"feature-shift-groups": "4"}, "feature-shift-groups: expected int, got '4'"),
    ({"dataset": "synthetic-fedfac", "feature-shift": "rotate"},
     "feature-shift: 'rotate' needs square images (C, H, W with H == W); this dataset's "
     "examples have shape (100,)"),
])
def test_bad_values_stop_the_run_with_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_settings(app_config(**{"dataset": "digits", **overrides}))
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_vector_dataset_without_the_shift_is_fine():
    load_settings(app_config(dataset="synthetic-fedfac"))


def test_non_square_images_stop_the_run_at_start(tmp_path):
    pool = tmp_path / "pool.npz"
    rng = np.random.default_rng(0)
    np.savez(pool, x=rng.normal(size=(60, 1, 8, 6)).astype(np.float32), y=np.arange(60) % 3)
    load_settings(app_config(dataset=str(pool)))  # fine unshifted
    with pytest.raises(ConfigError, match=r"feature-shift: 'rotate' needs square images .* "
                                          r"have shape \(1, 8, 6\)$"):
        load_settings(app_config(dataset=str(pool), **{"feature-shift": "rotate"}))


def test_a_client_refuses_to_turn_what_is_not_square():
    """A hub dataset whose ``input-shape`` was set wrong reaches the client unchecked."""
    with pytest.raises(ConfigError, match="have shape \\(1, 8, 6\\)"):
        feature_shift(np.zeros((3, 1, 8, 6), np.float32), "rotate", 4, 0)
    odd = np.zeros((3, 1, 8, 6), np.float32)
    assert feature_shift(odd, "none", 4, 1) is odd  # no shift: any shape passes
