"""The evidence matrix (bench/matrix.py): cells that resume, a report computed from the stored
runs (its search: tests/test_matrix_search.py; its verdicts: tests/test_matrix_claims.py;
protocol v4's rounds, seeds and picks: tests/test_matrix_v4*.py)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess

import numpy as np
import pytest
import torch

from bench.evidence import protocol
from bench.evidence.cells import Matrix, run, select
from bench.evidence.protocol import SCENARIOS
from bench.evidence.report import common_rounds, write_report
from bench.evidence.summary import thinned
from comparison.stats import last_rounds_mean
from tests.conftest import ROOT

# 3 local epochs: FedDecomp trains B A for 2 of them (its row's), sigma for the third
COMMON_DIGITS = {"dataset": "digits", "num-server-rounds": 2, "local-epochs": 3, "plot": False}


def _store(matrix: Matrix, scenario: str, item, config: dict, curve: list[float],
           stage: str = "tune", seed: int = 0) -> None:
    """A cell as ``Matrix.cell`` stores it (a tuning cell unless ``stage`` says), with the
    accuracy curve given (a tuning cell's is on validation splits)."""
    run_config = matrix.run_config(scenario, item, stage, config, seed, matrix.out)
    path = protocol.cell_path(matrix.out, scenario, item.label, stage, config, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "run_config": run_config, "resolved_config": matrix.store.resolved(run_config),
        "config": config, "num_clients": 3, "accuracy_per_round": curve, "accuracy_min": 0.0,
        "rounds": list(range(1, len(curve) + 1)),
        "evaluated_on": "validation" if stage == "tune" else "test", "seed": seed,
        "mb_up_total": 1.0, "seconds_total": 1.0}))


def only_rows(monkeypatch, *labels: str, scenario: str = "dirichlet-0.1") -> None:
    """The scenario with these rows alone (its rounds need every row of it tuned), and the
    ablations and privacy cells of those rows alone."""
    spec = SCENARIOS[scenario]
    monkeypatch.setitem(SCENARIOS, scenario, dataclasses.replace(
        spec, entries=[e for e in spec.entries if e.label in labels]))
    for name in ("ABLATIONS", "PRIVACY"):
        monkeypatch.setattr(protocol, name, [a for a in getattr(protocol, name)
                                             if a.scenario != scenario or a.label in labels])


def _tuned_fedavg(tmp_path) -> tuple[Matrix, protocol.Entry, dict]:
    """Dirichlet 0.1's FedAvg row with its whole search stored: the second largest learning
    rate wins (two-round tuning cells), and no further setting beats it."""
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    item = next(e for e in SCENARIOS["dirichlet-0.1"].entries if e.label == "fedavg")
    best = protocol.LR_GRID[-2]
    for k, lr in enumerate(protocol.LR_GRID):
        _store(offline, "dirichlet-0.1", item, {"lr": lr}, [0.1 * k if lr <= best else 0.0] * 2)
    for config in protocol.settings_stage("fedavg", best):
        _store(offline, "dirichlet-0.1", item, config, [0.0] * 2)
    return offline, item, {"lr": best}


def test_a_configuration_that_diverged_is_a_result_of_the_search_never_chosen(tmp_path):
    """lr 0.3 diverged (its run failed on non-finite losses): stored, so the search is
    complete, and the best of the others is chosen."""
    from comparison.runs import divergence

    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    item = next(e for e in SCENARIOS["dirichlet-0.1"].entries if e.label == "fedavg")
    for lr in protocol.LR_GRID[:-1]:
        _store(offline, "dirichlet-0.1", item, {"lr": lr}, [0.5 if lr == 0.03 else 0.4] * 2)
    _store(offline, "dirichlet-0.1", item, {"lr": 0.3}, [])
    path = protocol.cell_path(tmp_path, "dirichlet-0.1", "fedavg", "tune", {"lr": 0.3}, 0)
    cell = json.loads(path.read_text())
    del cell["accuracy_per_round"]
    path.write_text(json.dumps({**cell, "status": "diverged", "reason": "round 3: ..."}))
    searched = offline.searched("dirichlet-0.1", item, tune=False)
    assert len(searched) == len(protocol.LR_GRID) + protocol.EXTRA_CONFIGS
    assert all(c["lr"] == 0.03 for c, _ in searched[len(protocol.LR_GRID):])
    # a failed run is a divergence only where its replies stopped being finite
    for reason, diverged in (("round 40: no client's evaluation arrived (40 dropped: metric "
                              "'loss' is not finite)", True),
                             ("round 2: no reply within round-timeout", False)):
        results = {"status": "failed", "reason": reason}
        assert (divergence(results, completed=False) == reason) is diverged
    assert divergence({}, completed=False) is None  # it wrote no results.json


def test_a_tuning_cell_reads_the_tuning_pool_and_is_scored_on_validation_splits(tmp_path):
    item = next(e for e in SCENARIOS["dirichlet-0.1"].entries if e.label == "fedavg")
    matrix = Matrix(None, {**COMMON_DIGITS, "dataset": "/pools/report.npz"}, tmp_path,
                    num_clients=3, tuning={**protocol.TUNING, "dataset": "/pools/tuning.npz"})
    tune = matrix.run_config("dirichlet-0.1", item, "tune", {"lr": 0.03}, 0, tmp_path)
    report = matrix.run_config("dirichlet-0.1", item, "report", {"lr": 0.03}, 1, tmp_path)
    assert tune["dataset"] == "/pools/tuning.npz" and tune["validation-fraction"] > 0
    assert report["dataset"] == "/pools/report.npz" and "validation-fraction" not in report
    # a stored tuning run scored on its test split is never what chooses
    for lr in protocol.LR_GRID:
        _store(matrix, "dirichlet-0.1", item, {"lr": lr}, [0.5 if lr == 0.03 else 0.4] * 5)
    assert matrix.searched("dirichlet-0.1", item, tune=False)[-1][0]["lr"] == 0.03
    path = protocol.cell_path(tmp_path, "dirichlet-0.1", "fedavg", "tune", {"lr": 0.001}, 0)
    path.write_text(json.dumps({**json.loads(path.read_text()), "evaluated_on": "test"}))
    with pytest.raises(ValueError, match="validation accuracy only"):
        matrix.searched("dirichlet-0.1", item, tune=False)


def test_the_pools_are_disjoint(tmp_path, monkeypatch):
    """The tuning pool holds none of the report pool's images (drawn from Fashion-MNIST's
    60,000 where it is installed; skipped elsewhere)."""
    from bench.data import ensure_dataset
    if ensure_dataset("fashion-mnist") is None:
        pytest.skip("Fashion-MNIST's IDX files are not installed (apt-get install "
                    "dataset-fashion-mnist)")
    monkeypatch.setenv("HOME", str(tmp_path))
    report, tuning = (np.load(protocol.pool_file(500, role)) for role in ("report", "tuning"))
    rows = {x.tobytes() for x in report["x"]}
    assert len(tuning["x"]) == 500 and not rows & {x.tobytes() for x in tuning["x"]}


@pytest.mark.integration
def test_matrix_runs_missing_cells_once_and_reports_from_them(federation, tmp_path,
                                                              monkeypatch):
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1, 2))
    # 2-round curves are still rising: no longer runs here (the doubling has its own test)
    monkeypatch.setattr(protocol, "MAX_DOUBLINGS", 0)
    common = {"dataset": "digits", "num-server-rounds": 2, "local-epochs": 1, "plot": False}
    chosen = select(["dirichlet-0.1"], ["fedavg", "local"])
    assert [item.label for _, item in chosen] == ["fedavg", "local"]

    run(Matrix(federation, common, tmp_path, num_clients=3), chosen, "report")
    head = subprocess.run(["git", "describe", "--always", "--abbrev=7"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    cells = sorted((tmp_path / "matrix" / "cells").rglob("*.json"))
    assert len(cells) == 4
    stamps = [c.stat().st_mtime_ns for c in cells]
    for cell in map(lambda c: json.loads(c.read_text()), cells):
        results = json.loads((tmp_path / "matrix" / "runs" / cell["scenario"]
                              / cell["label"] / f"report-defaults-seed{cell['seed']}"
                              / "results.json").read_text())
        assert cell["accuracy_weighted"] == results["final"]["accuracy_weighted"]
        assert cell["run_config"]["num-server-rounds"] == 2 and len(cell["rounds"]) == 2
        assert cell["commit"].removesuffix("-dirty") == head  # which code produced it
        # and on what: another CPU moves a run beyond its last bits
        assert f"PyTorch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()} " \
            "kernels), numpy " in cell["numerics"]

    # resumed: nothing is run again
    run(Matrix(federation, common, tmp_path, num_clients=3), chosen, "report")
    assert [c.stat().st_mtime_ns for c in cells] == stamps
    # a cell run under another protocol is never read as today's
    other = Matrix(None, {**common, "num-server-rounds": 3}, tmp_path, num_clients=3)
    assert other.cell("dirichlet-0.1", chosen[0][1], "report", {}, 1) is None
    more_clients = Matrix(None, common, tmp_path, num_clients=4)
    assert more_clients.cell("dirichlet-0.1", chosen[0][1], "report", {}, 1) is None

    report = write_report(Matrix(None, common, tmp_path, num_clients=3),
                          "python bench/matrix.py")
    assert (tmp_path / "report.md").read_text() == report
    # each run's figure is the mean of its last 5 rounds, none in the first quarter: here its
    # second (comparison.stats.figure_rounds)
    fedavg = [last_rounds_mean(json.loads(c.read_text())["accuracy_per_round"]) for c in cells
              if c.parent.name == "fedavg"]
    row = next(line for line in report.splitlines() if line.startswith("| fedavg |"))
    assert (f"{100 * statistics.mean(fedavg):.1f} ± {100 * statistics.stdev(fedavg):.1f}") in row
    assert "not tuned yet" in row and "| 2 |" in row
    assert "FedDecomp >= FedAvg + 5 points on Dirichlet 0.1: **not measured**" in report
    summary = json.loads((tmp_path / "matrix" / "summary.json").read_text())
    assert summary["protocol"]["report_seeds"] == [1, 2]
    row = summary["rows"]["dirichlet-0.1/fedavg"]
    assert row["num_clients"] == 3 and not row["tuned"]
    assert {seed: r["curve"] for seed, r in row["per_seed"].items()} == {
        str(json.loads(c.read_text())["seed"]): json.loads(c.read_text())["accuracy_per_round"]
        for c in cells if c.parent.name == "fedavg"}
    assert row["mean"] == pytest.approx(statistics.mean(fedavg))
    assert (tmp_path / "matrix" / "accuracy-dirichlet-0.1.png").stat().st_size > 0
    assert (tmp_path / "matrix" / "accuracy-vs-uplink.png").stat().st_size > 0


def test_a_rows_curve_is_drawn_on_the_rounds_all_its_cells_evaluated():
    """A row whose seeds ran at different ``evaluate-every`` (1 and 10, over 35 rounds): its
    curve is on the rounds both evaluated; summary.json names the rounds of a thinned curve."""
    evaluated = [10, 20, *range(26, 36)]
    every = {"rounds": list(range(1, 36)), "accuracy_per_round": [r / 100 for r in range(1, 36)]}
    thin = {"rounds": evaluated, "accuracy_per_round": [r / 1000 for r in evaluated]}
    assert common_rounds([every, thin]) == (evaluated, [[r / 100 for r in evaluated],
                                                        [r / 1000 for r in evaluated]])
    assert thinned(every) == {} and thinned(thin) == {"rounds": evaluated}


@pytest.mark.integration
def test_an_ablation_runs_its_rows_tuned_configuration_with_one_change(federation, tmp_path,
                                                                       monkeypatch):
    """The tuning cells and the row's report cell are written here (their accuracies decide
    which configuration is kept); the ablation itself is a real run. The row chose a conv
    rank of its own, which the ablation's rank replaces: full rank in every layer."""
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1,))
    monkeypatch.setattr(protocol, "MAX_DOUBLINGS", 0)
    # 3 local epochs: the FedDecomp row trains tau for 2 of them and sigma for the third
    common = {"dataset": "digits", "num-server-rounds": 2, "local-epochs": 3, "plot": False}
    probe = protocol.Ablation("dirichlet-0.1", "feddecomp", {"feddecomp.rank": 1.0}, "why?")
    monkeypatch.setattr(protocol, "ABLATIONS", [probe])
    only_rows(monkeypatch, "feddecomp")  # its scenario's rounds: this row's alone
    offline = Matrix(None, common, tmp_path, num_clients=3)
    assert offline.ablation(probe) == []  # its row is not tuned yet
    item = next(e for e in SCENARIOS["dirichlet-0.1"].entries if e.label == "feddecomp")
    grid = protocol.learning_rate_stage() + protocol.settings_stage("feddecomp", 0.03)
    best = grid[len(protocol.LR_GRID) + 2]
    assert best == {"lr": 0.03, "feddecomp.rank-conv": 0.3}
    for k, config in enumerate(grid):
        accuracy = 0.9 if config == best else 0.5 if config == {"lr": 0.03} else 0.01 * k
        _store(offline, "dirichlet-0.1", item, config, [accuracy] * 2)
    assert offline.rounds("dirichlet-0.1") == 2  # fixed on validation: flat at the base

    [cell] = Matrix(federation, common, tmp_path, num_clients=3).ablation(probe)
    assert cell["stage"] == "ablation" and cell["config"] == {"lr": 0.03, "feddecomp.rank": 1.0}
    assert cell["run_config"]["lr"] == best["lr"]
    assert cell["run_config"]["feddecomp.rank-conv"] == 1.0
    assert cell["run_config"]["feddecomp.rank-linear"] == 1.0
    assert cell["run_config"]["feddecomp.lora-epochs"] == 2  # the row's fixed setting
    assert offline.ablation(probe) == [cell]  # stored: not run again


def test_a_cell_is_stale_when_a_default_its_method_ran_under_changed(tmp_path):
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    rows = {e.label: e for e in SCENARIOS["dirichlet-0.1"].entries}
    for label in ("fedavg", "fedfac"):
        _store(offline, "dirichlet-0.1", rows[label], {"lr": 0.05}, [0.5] * 2)

    def stored(matrix: Matrix, label: str) -> bool:
        return matrix.cell("dirichlet-0.1", rows[label], "tune", {"lr": 0.05}, 0,
                           may_run=False) is not None

    assert stored(offline, "fedavg") and stored(offline, "fedfac")
    changed = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    changed.store.defaults = {**changed.store.defaults, "fedfac.layers": "0"}
    # FedFac ran under -2: its cell is not today's; FedAvg's does not depend on FedFac's keys
    assert not stored(changed, "fedfac") and stored(changed, "fedavg")
    # a general one: every row's
    changed.store.defaults = {**offline.store.defaults, "weight-decay": 0.1}
    assert not stored(changed, "fedavg") and not stored(changed, "fedfac")
    # a key added since (a new option, its default keeping the old behaviour) is no change
    changed.store.defaults = {**offline.store.defaults, "some-new-option": 1}
    assert stored(changed, "fedavg") and stored(changed, "fedfac")
    # unless today's run sets it to another value than its default
    setting = Matrix(None, {**COMMON_DIGITS, "some-new-option": 2}, tmp_path, num_clients=3)
    setting.store.defaults = changed.store.defaults
    assert not stored(setting, "fedavg")
    # the pool in another home's cache (another machine) is the same pool; another file of
    # the same name is not
    home = Matrix(None, {**COMMON_DIGITS, "dataset": "/root/.cache/pflower/bench/pool.npz"},
                  tmp_path / "home", num_clients=3)
    _store(home, "dirichlet-0.1", rows["fedavg"], {"lr": 0.05}, [0.5] * 2)
    for dataset, same in (("/home/me/.cache/pflower/bench/pool.npz", True),
                          ("/data/bench/pool.npz", False), ("pool.npz", False)):
        home.common = {**COMMON_DIGITS, "dataset": dataset}
        assert stored(home, "fedavg") is same, dataset


def test_reproduce_calls_a_difference_a_regression_only_on_the_machine_that_stored_the_cell():
    from bench.reproduce import verdict

    here = "Xeon, PyTorch 2.14.1 (AVX512 kernels), numpy 2.4.6, scipy 1.17.1"
    assert verdict(True, "not recorded", here) == "yes"
    assert verdict(False, here, here) == "NO"
    assert verdict(False, here.replace("AVX512", "AVX2"), here) == (
        "no, as expected of another machine")
    assert verdict(False, "not recorded", here) == "no (where it was stored is not recorded)"


def test_reproduce_reruns_the_stored_cell_of_the_stage_asked_for_stored_here_first(tmp_path):
    from bench.evidence.protocol import cell_path
    from bench.reproduce import stored_cell

    here, elsewhere = "Xeon (AVX512 kernels)", "Epyc (AVX2 kernels)"
    stored = (("report", {"lr": 0.1}, 40, elsewhere),
              ("report", {"lr": 0.2, "num-server-rounds": 160}, 160, here),
              ("report", {"lr": 0.3, "num-server-rounds": 80}, 80, here),
              ("ablation", {"lr": 0.2, "fedfac.mode": "static"}, 40, here))
    for stage, config, rounds, numerics in stored:
        path = cell_path(tmp_path, "cross-device", "fedfac@dynamic", stage, config, 1)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"config": config, "numerics": numerics,
                                    "run_config": {"num-server-rounds": rounds}}))

    def chosen(**kwargs):
        cell = stored_cell("cross-device", "fedfac@dynamic", results=tmp_path, **kwargs)
        return cell and cell["config"]

    assert chosen(here=here) == {"lr": 0.3, "num-server-rounds": 80}
    assert chosen(here="another machine") == {"lr": 0.1}
    assert chosen(here=here, stage="ablation") == {"lr": 0.2, "fedfac.mode": "static"}
    assert chosen(here=here, seed=2) is None


def test_reproduce_compares_a_diverged_cell_by_its_reason():
    from bench.reproduce import same_run, shown

    finished = {"accuracy_per_round": [0.5, 0.6], "mb_up_per_round": [1.0, 1.0],
                "accuracy_weighted": 0.6, "mb_up_total": 2.0}
    diverged = {"status": "diverged", "reason": "rounds 10-12: the run diverged"}
    assert same_run(finished, dict(finished)) and not same_run(finished, None)
    assert not same_run(finished, {**finished, "accuracy_per_round": [0.5, 0.61]})
    assert same_run(diverged, dict(diverged))
    assert not same_run(diverged, {**diverged, "reason": "rounds 13-15: the run diverged"})
    assert not same_run(diverged, finished) and not same_run(finished, diverged)
    assert (shown(diverged), shown(finished)) == (
        "diverged (rounds 10-12: the run diverged)", "0.6000 / 2.000 MB")
