"""The evidence matrix (bench/matrix.py): equal tuning budgets, cells that resume, a report
computed from the stored runs, and the claim verdicts."""

from __future__ import annotations

import json
import statistics
import subprocess

import pytest

from bench.evidence import protocol
from bench.evidence.cells import Matrix, run, select
from bench.evidence.claims import claims
from bench.evidence.protocol import SCENARIOS, tuning_grid
from bench.evidence.report import write_report
from tests.conftest import ROOT


def test_every_row_gets_the_same_tuning_budget_of_learning_rate_and_one_hyperparameter():
    for _, entries in SCENARIOS.values():
        for item in entries:
            grid = tuning_grid(item.method)
            assert len(grid) == 4, item.label
            assert all("lr" in config and len(config) <= 2 for config in grid), item.label
            assert len({json.dumps(c, sort_keys=True) for c in grid}) == 4, item.label


def test_the_tuned_rank_sets_both_ranks_and_a_rank_an_ablation_names_wins():
    assert protocol.expand({"lr": 0.05, "feddecomp.rank": 0.25}) == {
        "lr": 0.05, "feddecomp.rank-conv": 0.25, "feddecomp.rank-linear": 0.25}
    assert protocol.expand({"feddecomp.rank": 0.25, "feddecomp.rank-conv": 1.0}) == {
        "feddecomp.rank-conv": 1.0, "feddecomp.rank-linear": 0.25}


def _row(accuracy: float, mb_up: float = 10.0, seeds: int = 3, tuned: bool = True) -> dict:
    return {"accuracy": (accuracy, 0.0), "mb_up": (mb_up, 0.0), "seeds": seeds, "tuned": tuned}


def test_a_cell_of_a_two_key_config_is_named_without_a_comma():
    # Flower's FAB manifest is comma-separated: such a name under the app breaks `flwr run .`
    path = protocol.cell_path(ROOT, "dirichlet-0.1", "fedfac@dynamic", "tune",
                            {"lr": 0.02, "fedfac.tau-quantile": 0.3}, 0)
    assert "," not in path.name and "lr=0.02" in path.name


def test_claims_are_judged_on_the_thresholds_and_missing_rows_say_not_measured():
    stats = {
        "dirichlet-0.1": {"fedavg": _row(0.60), "feddecomp": _row(0.66), "fedper": _row(0.68),
                          "fedrep": _row(0.67), "fedfac": _row(0.62)},
        "pathological-2": {"fedavg": _row(0.70), "pfedc": _row(0.90), "fedrep": _row(0.905)},
        "permuted-labels": {"factorized-fl": _row(0.80, 0.4), "local": _row(0.805),
                            "fedavg": _row(0.3, 10.0)},
        "synthetic-fedfac": {"fedfac": _row(0.75), "fedfac@random-split": _row(0.70),
                             "fedfac@dynamic": _row(0.75)},
    }
    # the split is judged against its own row's random split of the same size (an ablation),
    # not the separately tuned random-split row (0.70 here, which it would beat)
    same_size = protocol.config_tag(protocol.SAME_SIZE_RANDOM_SPLIT)
    ablated = {("synthetic-fedfac", "fedfac", same_size): {"accuracy": (0.76, 0.0), "seeds": 3},
               ("synthetic-fedfac", "fedfac@dynamic", same_size): {"accuracy": (0.76, 0.0),
                                                                   "seeds": 2}}
    lines = claims(stats, ablated)
    verdict = {line.split(":")[0][2:]: line for line in lines}
    assert "**held**" in verdict["FedDecomp >= FedAvg + 5 points on Dirichlet 0.1"]
    assert "**did not hold**" in verdict[
        "FedDecomp not below the best of FedPer/FedRep by more than 1 point"]
    assert "**held**" in verdict["pFedC >= FedAvg + 5 points on pathological-2"]
    assert "**held**" in verdict["pFedC not below FedRep by more than 1 point on pathological-2"]
    assert "**held**" in next(v for k, v in verdict.items() if k.startswith("Factorized-FL"))
    assert "**did not hold**" in verdict["FedFac (fedfac) >= FedAvg + 3 points on Dirichlet 0.1"]
    split_claim = ("FedFac ({}) split at least as good as a random split of the same size "
                   "(eq. 8 simulation)")
    assert "**did not hold**" in verdict[split_claim.format("fedfac")]
    assert "**not measured**" in verdict[split_claim.format("fedfac@dynamic")]  # 2 seeds of 3
    assert "**not measured**" in {line.split(":")[0][2:]: line for line in claims(stats)}[
        split_claim.format("fedfac")]  # no same-size reference run
    assert "**not measured**" in verdict[
        "FedFac (fedfac@dynamic) >= FedAvg + 3 points on Dirichlet 0.1"]
    # 1/20 of FedAvg's uplink is part of the Factorized-FL claim
    stats["permuted-labels"]["factorized-fl"] = _row(0.80, 0.6)
    assert "**did not hold**" in next(line for line in claims(stats, ablated)
                                      if "Factorized-FL" in line)
    # a row still running (one seed of three) or not tuned gives no verdict
    stats["dirichlet-0.1"]["fedfac"] = _row(0.70, seeds=1)
    stats["pathological-2"]["pfedc"] = _row(0.90, tuned=False)
    partial = {line.split(":")[0][2:]: line for line in claims(stats)}
    assert "**not measured**" in partial["FedFac (fedfac) >= FedAvg + 3 points on Dirichlet 0.1"]
    assert "**not measured**" in partial["pFedC >= FedAvg + 5 points on pathological-2"]


@pytest.mark.integration
def test_matrix_runs_missing_cells_once_and_reports_from_them(federation, tmp_path,
                                                              monkeypatch):
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1, 2))
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
    # each run's figure is the mean of its last 5 rounds: here both of its 2
    fedavg = [statistics.mean(json.loads(c.read_text())["accuracy_per_round"]) for c in cells
              if c.parent.name == "fedavg"]
    row = next(line for line in report.splitlines() if line.startswith("| fedavg |"))
    assert (f"{statistics.mean(fedavg):.4f} ± {statistics.stdev(fedavg):.4f}") in row
    assert "not tuned yet" in row and "| 2 |" in row
    assert "FedDecomp >= FedAvg + 5 points on Dirichlet 0.1: **not measured**" in report
    assert (tmp_path / "matrix" / "accuracy-dirichlet-0.1.png").stat().st_size > 0
    assert (tmp_path / "matrix" / "accuracy-vs-uplink.png").stat().st_size > 0


def test_an_ablation_runs_its_rows_tuned_configuration_with_one_change(federation, tmp_path,
                                                                       monkeypatch):
    """The tuning cells are written here (their accuracies decide which configuration is
    kept); the ablation itself is a real run."""
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1,))
    common = {"dataset": "digits", "num-server-rounds": 2, "local-epochs": 2, "plot": False}
    probe = protocol.Ablation("dirichlet-0.1", "feddecomp", {"feddecomp.rank": 1.0}, "why?")
    monkeypatch.setattr(protocol, "ABLATIONS", [probe])
    grid = tuning_grid("feddecomp")
    offline = Matrix(None, common, tmp_path, num_clients=3)
    assert offline.ablation(probe) == []  # its row is not tuned yet
    item = next(e for e in SCENARIOS["dirichlet-0.1"][1] if e.label == "feddecomp")
    best = grid[2]
    for k, config in enumerate(grid):
        path = protocol.cell_path(tmp_path, "dirichlet-0.1", "feddecomp", "tune", config, 0)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"run_config": offline.run_config(
            "dirichlet-0.1", item, config, 0, tmp_path), "config": config,
            "num_clients": 3, "accuracy_weighted": 0.9 if config == best else 0.1 * k}))

    [cell] = Matrix(federation, common, tmp_path, num_clients=3).ablation(probe)
    assert cell["stage"] == "ablation" and cell["config"] == {**best, "feddecomp.rank": 1.0}
    assert cell["run_config"]["lr"] == best["lr"]
    assert cell["run_config"]["feddecomp.rank-conv"] == 1.0 != best["feddecomp.rank"]
    assert offline.ablation(probe) == [cell]  # stored: not run again
