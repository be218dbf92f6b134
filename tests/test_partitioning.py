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


# --------------------------------------------------------------- a pure function of the run
# Digests of every client's indices, in client order, as the partitioning computed them before
# a failed draw stopped being kept (the stored evidence cells were drawn this way): a
# partition that draws on the first try must stay exactly this.
DRAWN_BEFORE = {
    "digits-dirichlet-0.1": ({"partitioner": "dirichlet", "dirichlet-alpha": 0.1, "seed": 1},
                             20, "203d5bcececd664a"),
    "digits-dirichlet-0.5": ({"partitioner": "dirichlet", "seed": 3}, 10, "1db184120d1fb7c0"),
    "digits-pathological-2": ({"partitioner": "pathological", "seed": 1}, 10, "95e457a589df1c30"),
    "digits-iid": ({"partitioner": "iid", "seed": 2}, 7, "40cbd118e46a83af"),
    "digits-domain": ({"partitioner": "domain", "seed": 1}, 6, "b78cc861575b21d9"),
}


def digest(parts: list[np.ndarray]) -> str:
    import hashlib

    h = hashlib.sha256()
    for part in parts:
        h.update(np.asarray(part, dtype=np.int64).tobytes())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("name", sorted(DRAWN_BEFORE))
def test_a_partition_that_draws_at_once_is_what_it_was(name):
    overrides, n, expected = DRAWN_BEFORE[name]
    assert digest(all_partitions(settings(**overrides), n)) == expected


# 600 labels over 100 clients, at least 2 each: no draw in flwr-datasets' 10 succeeds with this
# seed, but a kept partitioner used to succeed at its 5th call, from where its failed draws left
# its generator
SMALL_POOL = np.repeat(np.arange(10), 60)
TIGHT = {"partitioner": "dirichlet", "min-partition-size": 2, "seed": 0}
FEASIBLE = {"partitioner": "dirichlet", "dirichlet-alpha": 0.3, "seed": 4}


def test_a_failed_draw_fails_the_same_way_however_often_a_process_asks():
    s = settings(**TIGHT)
    messages = set()
    for _ in range(6):
        with pytest.raises(ConfigError, match="no draw in 10") as refused:
            partition_indices(SMALL_POOL, s, 0, 100)
        messages.add(str(refused.value))
    assert len(messages) == 1


_FRESH_PROCESS = """
import json, sys
import numpy as np
from fldata.partition import partition_indices
from fldata.sources import digits_pool
from strategies.registry import load_settings
from tests.conftest import app_config
s = load_settings({**app_config(), "dataset": "digits", **json.loads(sys.argv[1])})
_, y = digits_pool()
print(json.dumps([partition_indices(y, s, pid, 20).tolist() for pid in json.loads(sys.argv[2])]))
"""


def test_a_client_gets_the_same_partition_in_a_fresh_process_and_in_one_that_saw_failed_draws():
    """A deployed site computes its partition in a process of its own; a simulation worker
    serves many clients, after whatever it ran before (here: failed draws of other settings
    and of a pool too small for them). Both must get the same indices, and together the
    clients hold every example once."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    for _ in range(3):
        with pytest.raises(ConfigError):
            partition_indices(SMALL_POOL, settings(**TIGHT), 0, 100)
    _, y = digits_pool()
    worker = all_partitions(settings(**FEASIBLE), 20)
    root = Path(__file__).resolve().parents[1]
    fresh = []
    for pids in ([0, 7], [19, 3]):  # two sites, each a process of its own
        done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, json.dumps(FEASIBLE),
                               json.dumps(pids)], cwd=root, capture_output=True, text=True,
                              check=True)
        fresh += list(zip(pids, json.loads(done.stdout.splitlines()[-1]), strict=True))
    for pid, indices in fresh:
        np.testing.assert_array_equal(worker[pid], indices)
    joined = np.concatenate(worker)
    assert len(joined) == len(np.unique(joined)) == len(y)


def test_the_stored_evidence_cells_were_drawn_on_todays_partition():
    """A report cell of the evidence matrix (Fashion-MNIST, 20 clients, Dirichlet 0.1):
    every round's weighted accuracy in it is a whole number of correct answers over the test
    examples today's partition gives its clients, and over no neighbouring count."""
    import json
    from pathlib import Path

    from fldata.idx import find_idx_dir

    if find_idx_dir("fashion-mnist", "", "/usr/share/datasets/fashion-mnist") is None:
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist)")
    from bench.evidence.protocol import pool_file

    root = Path(__file__).resolve().parents[1]
    cell = json.loads((root / "bench/results/matrix/cells/dirichlet-0.1/fedavg/"
                       "report-local-epochs=10+lr=0.01+num-server-rounds=160-seed1.json"
                       ).read_text())
    s = load_settings({**app_config(), **cell["resolved_config"], "dataset": str(pool_file()),
                       "output-dir": ""})
    tests = sum(len(load_client_data(s, pid, cell["num_clients"]).y_test)
                for pid in range(cell["num_clients"]))
    accuracies = np.asarray(cell["accuracy_per_round"])
    assert len(accuracies) == 160

    def off_whole(total: int) -> float:
        return float(np.abs(accuracies * total - np.round(accuracies * total)).max())

    assert off_whole(tests) < 1e-9
    assert min(off_whole(tests + d) for d in (-2, -1, 1, 2)) > 0.1


def test_the_whole_partition_is_checked_before_any_client_starts():
    """``check_partition`` draws every client's split on the pool's labels: a client left
    without an evaluation example is refused with the fix named; clients evaluated on a
    handful of examples are warned about, once, with how many and how small."""
    from fldata import check_partition
    from fldata.partition import SMALL_TEST_SPLIT

    assert check_partition(settings(partitioner="iid"), 10) is None
    with pytest.raises(ConfigError, match=r"\d+ of 1000 clients get no test example .*use "
                                          "fewer clients"):
        check_partition(settings(partitioner="iid"), 1000)  # 1 or 2 digits a client
    warning = check_partition(settings(partitioner="iid", **{"test-fraction": 0.02}), 40)
    assert warning is not None
    sizes = [len(load_client_data(settings(partitioner="iid", **{"test-fraction": 0.02}),
                                  pid, 40).y_test) for pid in range(40)]
    small = sum(size < SMALL_TEST_SPLIT for size in sizes)
    assert warning.startswith(f"{small} of 40 clients are evaluated on fewer than "
                              f"{SMALL_TEST_SPLIT} test examples (the smallest on {min(sizes)})")
    with pytest.raises(ConfigError, match="no draw in 10"):
        check_partition(settings(partitioner="dirichlet", **{"min-partition-size": 17}), 100)


def test_a_client_without_an_example_says_so_in_one_line():
    """Without a launcher's check first (a plain ``flwr run``), a client whose partition is
    empty (1,000 clients on the 1,797 digits, each at least 0) refuses with one line: every
    such client the same way, so that the run stops at its preflight with it."""
    s = settings(partitioner="dirichlet")
    sizes = [len(partition_indices(digits_pool()[1], s, pid, 1000)) for pid in range(1000)]
    empty = sizes.index(0)
    with pytest.raises(ConfigError, match=rf"^partitioner: client {empty} of 1000 gets no "
                                          "example of the pool; use fewer clients$"):
        load_client_data(s, empty, 1000)
