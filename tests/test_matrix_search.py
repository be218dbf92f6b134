"""The evidence matrix's search (bench/evidence/cells.py, protocol.py): one learning-rate
grid and the same budget for every row, steps past the grid where a row's best rate is an end
of it, the best rate then the best setting by the last rounds, the papers' ranges, ranks."""

from __future__ import annotations

import json

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.protocol import SCENARIOS
from bench.evidence.report import write_report
from bench.evidence.stats import row_stats
from bench.evidence.summary import lr_at_grid_end
from tests.test_matrix import COMMON_DIGITS, _store


def test_every_row_searches_the_same_learning_rates_and_the_same_extra_budget(tmp_path):
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    lrs = len(protocol.LR_GRID)
    for scenario, spec in SCENARIOS.items():
        for item in spec.entries:
            home = spec.searched_on or scenario
            for k, lr in enumerate(protocol.LR_GRID):  # 0.03 is best for every row
                _store(offline, home, item, {"lr": lr}, [0.9 if lr == 0.03 else 0.1 * k] * 5)
            searched = [c for c, _ in offline.searched(scenario, item, tune=False)]
            assert [c["lr"] for c in searched[:lrs]] == list(protocol.LR_GRID), item.label
            extra = searched[lrs:]
            assert len(extra) == protocol.EXTRA_CONFIGS, item.label
            assert all(c["lr"] == 0.03 and len(c) > 1 for c in extra), item.label
            # in full (summary.json's grid): the method's defaults, the row's fixed settings
            full = offline.method_config(scenario, item, searched[0])
            assert all(full[k] == v for k, v in item.fixed.items()), item.label
            # and every configuration apart: a common knob is listed with the learning rate
            grid = [offline.method_config(scenario, item, c) for c in searched]
            assert all(grid.count(c) == 1 for c in grid), (item.label, grid)
    # a row without settings of its own searches the common knobs; FedRep fills its three
    assert protocol.settings_stage("fedavg", 0.03) == [
        {"lr": 0.03, **knob} for knob in protocol.COMMON_KNOBS]
    assert protocol.settings_stage("fedrep", 0.03)[-1] == {"lr": 0.03,
                                                           **protocol.COMMON_KNOBS[0]}
    # a grid of two and a half decades, so that a row's choice should lie inside it (one at
    # an end steps past it: the next test)
    assert protocol.LR_GRID[-1] / protocol.LR_GRID[0] >= 100


def test_a_best_rate_at_an_end_of_the_grid_steps_past_it_within_the_same_budget(tmp_path):
    """Up to two steps past the end its best is at, each in place of a further configuration:
    every row still tries the same number; summary.json says where a row ends at an end."""
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    item = next(e for e in SCENARIOS["dirichlet-0.1"].entries if e.label == "fedavg")

    def store(lr: float, accuracy: float) -> None:
        _store(offline, "dirichlet-0.1", item, {"lr": lr}, [accuracy] * 2)

    def search() -> list[dict]:
        return [c for c, _ in offline.searched("dirichlet-0.1", item, tune=False)]

    for k, lr in enumerate(protocol.LR_GRID):  # rising to the largest rate
        store(lr, 0.1 * k)
    assert search()[len(protocol.LR_GRID):] == [{"lr": 1.0}]
    store(1.0, 0.8)  # better still: one more step
    assert search()[len(protocol.LR_GRID):] == [{"lr": 1.0}, {"lr": 3.0}]
    store(3.0, 0.0)  # worse: 1.0 lies inside the rates tried, two settings are left
    assert search()[len(protocol.LR_GRID):] == [
        {"lr": 1.0}, {"lr": 3.0}, *protocol.settings_stage("fedavg", 1.0)[:2]]
    assert len(search()) == len(protocol.LR_GRID) + protocol.EXTRA_CONFIGS

    low = Matrix(None, COMMON_DIGITS, tmp_path / "low", num_clients=3)
    for k, lr in enumerate((0.0001, 0.0003, *protocol.LR_GRID)):  # falling from the smallest
        _store(low, "dirichlet-0.1", item, {"lr": lr}, [0.9 - 0.1 * k] * 2)
    searched = [c for c, _ in low.searched("dirichlet-0.1", item, tune=False)]
    assert searched[len(protocol.LR_GRID):] == [
        {"lr": 0.0003}, {"lr": 0.0001}, *protocol.settings_stage("fedavg", 0.0001)[:2]]
    for matrix, lr in ((offline, 1.0), (low, 0.0001)):
        for config in protocol.settings_stage("fedavg", lr)[:2]:
            _store(matrix, "dirichlet-0.1", item, config, [0.0] * 2)
        for seed in protocol.REPORT_SEEDS:
            _store(matrix, "dirichlet-0.1", item, {"lr": lr}, [0.5] * 2, stage="report",
                   seed=seed)
    inside, at_end = (row_stats(m, "dirichlet-0.1", item) for m in (offline, low))
    assert (inside["chosen"]["lr"], at_end["chosen"]["lr"]) == (1.0, 0.0001)
    assert len(inside["grid"]) == len(at_end["grid"]) == 10
    # no third step: the row is named as still at an end of its search, either end
    assert not lr_at_grid_end(inside) and lr_at_grid_end(at_end)
    assert lr_at_grid_end({**inside, "chosen": {"lr": 3.0},
                           "grid": [*inside["grid"], {"lr": 3.0}]})
    report = write_report(low, "python bench/matrix.py")
    assert ("## Rows whose learning rate is an end of their search" in report
            and "- dirichlet-0.1/fedavg: lr 0.0001 of [0.0001, 0.0003, 0.001," in report)
    summary = json.loads((tmp_path / "low" / "matrix" / "summary.json").read_text())
    assert summary["rows"]["dirichlet-0.1/fedavg"]["lr_at_grid_end"] is True
    assert summary["protocol"]["lr_steps_past_the_grid"] == {
        "below": [0.0003, 0.0001], "above": [1.0, 3.0], "at_most": 2}
    # the report counts its cells by the CPU and packages they ran on: these record none
    # (8 learning rates, 2 settings, 10 report seeds)
    assert "reproducibility): not recorded 20)" in report


def test_the_paper_methods_search_the_ranges_their_papers_report():
    settings = protocol.SETTINGS
    assert any(c.get("fedfac.layers") not in (None, "0") for c in settings["fedfac"])
    assert max(c.get("fedfac.tau-quantile", 0) for c in settings["fedfac"]) >= 0.9
    # every one a split (the analysed layer wholly personal, its authors' CIFAR setting, is an
    # ablation: tests/test_matrix_v4_verdicts.py); Factorized-FL's L1 above 0 in every one
    assert all(0 < c.get("fedfac.tau-quantile", 0.9) < 1 for c in settings["fedfac"])
    assert 0.0 not in {c.get("factorized-fl.l1") for c in settings["factorized-fl"]}
    assert {c.get("factorized-fl.l1") for c in settings["factorized-fl"]} >= {0.005, 0.00005}
    # mu starts at zeros, the paper's; the authors' code's Xavier start is a setting
    assert protocol.FACTORIZED_FL.fixed == {"factorized-fl.mu-init": "zeros"}
    assert {"factorized-fl.mu-init": "xavier"} in settings["factorized-fl"]
    assert any(c.get("factorized-fl.tau") == 0.95 and c.get("factorized-fl.epsilon") == 20.0
               and c.get("factorized-fl.min-aggregated") == 4
               for c in settings["factorized-fl"])
    # FedDecomp's scale is searched: the authors' (its default) against the other two
    assert {c.get("feddecomp.tau-scale") for c in settings["feddecomp"]} >= {"inverse-rank",
                                                                            "none"}
    # the first stage runs the papers' defaults: FedDecomp's 2 low-rank epochs of 5
    assert protocol.COMMON["local-epochs"] == 5
    assert protocol.FEDDECOMP.fixed == {"feddecomp.lora-epochs": 2}


def test_the_search_takes_the_best_learning_rate_then_the_best_setting_by_the_last_rounds(
        tmp_path):
    item = next(e for e in SCENARIOS["dirichlet-0.1"].entries if e.label == "fedprox")
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)

    def store(config, curve):
        _store(offline, "dirichlet-0.1", item, config, curve)

    # 0.01 has the best final round, 0.03 the best last 5 rounds: 0.03 is kept
    for lr in protocol.LR_GRID:
        store({"lr": lr}, {0.01: [0.5] * 9 + [0.9], 0.03: [0.7] * 10}.get(lr, [0.1] * 10))
    assert offline.tuned("dirichlet-0.1", item, tune=False) == ({}, False)  # stage 2 missing
    searched = offline.searched("dirichlet-0.1", item, tune=False)
    assert ([c for c, _ in searched][len(protocol.LR_GRID):]
            == protocol.settings_stage("fedprox", 0.03))
    for k, config in enumerate(protocol.settings_stage("fedprox", 0.03)):
        store(config, [0.8 if k == 2 else 0.6] * 10)
    chosen, tuned = offline.tuned("dirichlet-0.1", item, tune=False)
    assert tuned and chosen == protocol.settings_stage("fedprox", 0.03)[2]
    # cross-device is not searched again: its rows report what they chose on Dirichlet 0.1
    assert protocol.SCENARIOS["cross-device"].searched_on == "dirichlet-0.1"
    assert offline.tuned("cross-device", item, tune=False) == (chosen, True)


def test_the_tuned_rank_sets_both_ranks_and_a_rank_an_ablation_names_wins():
    assert protocol.expand({"lr": 0.05, "feddecomp.rank": 0.25}) == {
        "lr": 0.05, "feddecomp.rank-conv": 0.25, "feddecomp.rank-linear": 0.25}
    assert protocol.expand({"feddecomp.rank": 0.25, "feddecomp.rank-conv": 1.0}) == {
        "feddecomp.rank-conv": 1.0, "feddecomp.rank-linear": 0.25}
    # an ablation's rank replaces a tuned conv rank (the search's 0.3): full rank everywhere
    changed = protocol.with_change({"lr": 0.03, "feddecomp.rank-conv": 0.3},
                                   {"feddecomp.rank": 1.0})
    assert protocol.expand(changed) == {"lr": 0.03, "feddecomp.rank-conv": 1.0,
                                        "feddecomp.rank-linear": 1.0}
    # and an ablation's conv rank replaces only the conv rank of a tuned rank
    changed = protocol.with_change({"feddecomp.rank": 0.25}, {"feddecomp.rank-conv": 1.0})
    assert protocol.expand(changed) == {"feddecomp.rank-conv": 1.0,
                                        "feddecomp.rank-linear": 0.25}


def test_a_grid_where_every_rate_diverged_steps_below_it(tmp_path):
    """The widening ``choose`` asks for when nothing finished, instead of its error."""
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    item = next(e for e in SCENARIOS["dirichlet-0.1"].entries if e.label == "fedavg")

    def diverged(lr: float) -> None:
        _store(offline, "dirichlet-0.1", item, {"lr": lr}, [])
        path = protocol.cell_path(tmp_path, "dirichlet-0.1", "fedavg", "tune", {"lr": lr}, 0)
        cell = json.loads(path.read_text())
        path.write_text(json.dumps({**cell, "status": "diverged", "reason": "round 3: ..."}))

    for lr in protocol.LR_GRID:
        diverged(lr)
    searched = [c for c, _ in offline.searched("dirichlet-0.1", item, tune=False)]
    assert searched[len(protocol.LR_GRID):] == [{"lr": 0.0003}]
    _store(offline, "dirichlet-0.1", item, {"lr": 0.0003}, [0.5] * 2)  # the best: an end
    searched = [c for c, _ in offline.searched("dirichlet-0.1", item, tune=False)]
    assert searched[len(protocol.LR_GRID):] == [{"lr": 0.0003}, {"lr": 0.0001}]
