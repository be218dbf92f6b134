"""Partitioners: deterministic, disjoint, covering; pathological and permuted labels."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import ConfigError, RunSettings
from fldata import load_client_data
from fldata.partition import label_permutation, partition_indices, train_test_split
from fldata.sources import digits_pool
from strategies.registry import load_settings
from tests.conftest import app_config


def settings(**overrides) -> RunSettings:
    return load_settings({**app_config(), "dataset": "digits", **overrides})


def all_partitions(s: RunSettings, n: int) -> list[np.ndarray]:
    _, y = digits_pool()
    return [partition_indices(y, s, pid, n) for pid in range(n)]


@pytest.mark.parametrize("overrides", [
    {"partitioner": "iid"},
    {"partitioner": "dirichlet", "dirichlet-alpha": 0.1},
    {"partitioner": "dirichlet", "dirichlet-alpha": 0.5},
    {"partitioner": "pathological", "classes-per-client": 2},
    {"partitioner": "domain", "domain-groups": 2},
])
def test_partitions_are_deterministic_disjoint_and_cover(overrides):
    s = settings(**overrides)
    n = 10
    first, second = all_partitions(s, n), all_partitions(s, n)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    joined = np.concatenate(first)
    assert len(joined) == len(np.unique(joined)), "partitions overlap"
    assert len(joined) == len(digits_pool()[1]), "partitions do not cover the pool"
    assert all(len(p) > 0 for p in first)


def test_seed_changes_the_partition():
    a = all_partitions(settings(partitioner="dirichlet", seed=1), 5)
    b = all_partitions(settings(partitioner="dirichlet", seed=2), 5)
    assert any(len(x) != len(y) or (x != y).any() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_pathological_gives_exactly_k_labels(k):
    s = settings(partitioner="pathological", **{"classes-per-client": k})
    for pid in range(10):
        data = load_client_data(s, pid, 10)
        assert len(np.unique(data.y_train)) == k
        assert set(np.unique(data.y_test)) <= set(np.unique(data.y_train))


def test_domain_groups_hold_disjoint_classes():
    s = settings(partitioner="domain", **{"domain-groups": 2})
    labels = [set(np.unique(load_client_data(s, pid, 6).y_train)) for pid in range(6)]
    for pid in range(6):
        for other in range(6):
            same_domain = pid % 2 == other % 2
            assert (labels[pid] == labels[other]) if same_domain else not labels[pid] & labels[
                other]


def test_permute_labels_is_a_per_client_bijection():
    plain = settings(partitioner="iid")
    permuted = settings(partitioner="iid", **{"permute-labels": True})
    perms = []
    for pid in range(4):
        a, b = load_client_data(plain, pid, 4), load_client_data(permuted, pid, 4)
        perm = label_permutation(10, permuted.seed, pid)
        assert sorted(perm) == list(range(10))
        np.testing.assert_array_equal(perm[a.y_train], b.y_train)
        np.testing.assert_array_equal(a.x_train, b.x_train)
        perms.append(tuple(perm))
    assert len(set(perms)) == 4, "clients share a permutation"


def test_test_split_has_the_train_distribution():
    s = settings(partitioner="dirichlet", **{"dirichlet-alpha": 0.3})
    for pid in range(5):
        data = load_client_data(s, pid, 5)
        train = np.bincount(data.y_train, minlength=10) / len(data.y_train)
        test = np.bincount(data.y_test, minlength=10) / len(data.y_test)
        assert np.abs(train - test).max() < 0.1
        assert abs(len(data.y_test) / (len(data.y_test) + len(data.y_train)) - 0.2) < 0.05


def test_train_test_split_is_disjoint_and_stratified():
    labels = np.repeat(np.arange(4), [10, 20, 1, 5])
    train, test = train_test_split(labels, 0.2, seed=0, partition_id=0)
    assert not set(train) & set(test) and len(train) + len(test) == len(labels)
    assert np.bincount(labels[test], minlength=4).tolist() == [2, 4, 0, 1]
    # a class's single example stays in train even where its share would round to one
    labels = np.repeat(np.arange(2), [3, 1])
    train, test = train_test_split(labels, 0.7, seed=0, partition_id=0)
    assert np.bincount(labels[test], minlength=2).tolist() == [2, 0]
    assert labels[train].tolist() == [0, 1]


@pytest.mark.parametrize("labels", [[3, 7], [0, 1, 2], [5, 5, 1, 2]])
def test_a_client_of_a_few_single_examples_still_gets_a_test_example(labels):
    # stratified, each label's single example would stay in train and leave no test split
    train, test = train_test_split(np.array(labels), 0.2, seed=0, partition_id=0)
    assert len(test) == 1 and len(train) == len(labels) - 1
    assert sorted([*train, *test]) == list(range(len(labels)))


def test_partition_id_out_of_range_is_a_clear_error():
    with pytest.raises(ConfigError, match="partition-id"):
        load_client_data(settings(), 4, 4)


def test_a_process_partitions_the_pool_once_and_gives_what_a_fresh_partitioning_gives(
        monkeypatch):
    """Many clients in one process (a simulation worker): the pool is partitioned once per
    settings, and each client's indices equal those of a partitioner made for it alone."""
    import fldata.partition as partition

    made = []
    make = partition.make_partitioner
    monkeypatch.setattr(partition, "make_partitioner",
                        lambda *args, **kw: made.append(args) or make(*args, **kw))
    partition._PARTITIONERS.clear()
    s = settings(partitioner="dirichlet", **{"dirichlet-alpha": 0.3})
    _, y = digits_pool()
    shared = [partition_indices(y, s, pid, 20) for pid in range(20)]
    assert len(made) == 1
    fresh = []
    for pid in range(20):
        partition._PARTITIONERS.clear()
        fresh.append(partition_indices(y, s, pid, 20))
    for a, b in zip(shared, fresh, strict=True):
        np.testing.assert_array_equal(a, b)
    # other settings or another number of clients: another partitioning, never the kept one
    other = partition_indices(y, settings(partitioner="dirichlet", **{"dirichlet-alpha": 0.5}),
                              0, 20)
    assert not np.array_equal(other, shared[0])
    assert len(partition_indices(y, s, 0, 10)) != len(shared[0])


def test_many_clients_on_a_small_pool_get_a_clear_error_and_min_partition_size_fixes_it():
    # 1,000 clients of 20 examples on average: Dirichlet 0.5 never gives all of them 10
    labels = np.random.default_rng(0).integers(0, 10, 20_000)
    with pytest.raises(ConfigError, match="lower min-partition-size"):
        partition_indices(labels, settings(partitioner="dirichlet"), 0, 1000)
    relaxed = settings(partitioner="dirichlet", **{"min-partition-size": 2})
    sizes = [len(partition_indices(labels, relaxed, pid, 1000)) for pid in range(1000)]
    assert min(sizes) >= 2 and sum(sizes) == len(labels)


def test_min_partition_size_is_capped_at_half_an_even_share_so_a_small_pool_stays_drawable():
    """100 clients on the 1,797 digits: an even share is 17, so ``min-partition-size = 50``
    is read as 8 (half of it) instead of asking for more examples than the pool holds."""
    s = settings(partitioner="dirichlet", **{"dirichlet-alpha": 100.0, "min-partition-size": 50})
    sizes = [len(p) for p in all_partitions(s, 100)]
    assert min(sizes) >= 8 and sum(sizes) == 1797


def _rows(x: np.ndarray) -> set[bytes]:
    return {row.tobytes() for row in x.reshape(len(x), -1)}


def test_a_validation_split_is_carved_from_the_training_share_and_never_holds_a_test_example():
    """A tuning run (validation-fraction > 0) is evaluated on examples of its clients'
    training shares; the test split of the same seed is neither trained nor evaluated on."""
    for partition in range(3):
        plain = load_client_data(load_settings(app_config()), partition, 5)
        tuning = load_client_data(load_settings(app_config(**{"validation-fraction": 0.5})),
                                  partition, 5)
        train, test = _rows(plain.x_train), _rows(plain.x_test)
        validation, fit = _rows(tuning.x_test), _rows(tuning.x_train)
        assert validation and fit and validation <= train and fit <= train
        assert not validation & test and not fit & test and not validation & fit
        assert len(validation) == pytest.approx(len(train) / 2, abs=len(np.unique(
            plain.y_train)))  # half of each class, rounded
