"""The matrix's privacy-utility evidence (bench/evidence/privacy.py): DP cells at a row's tuned
configuration, compared seed by seed with FedAvg and FedPer at the same noise multiplier."""

from __future__ import annotations

import json

import pytest

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.privacy import level_epsilons, privacy_stats, privacy_tables
from bench.evidence.protocol import SCENARIOS
from bench.evidence.report import write_report
from tests.test_matrix import COMMON_DIGITS, _store

SCENARIO = "dirichlet-0.1"


def _entry(label: str):
    return next(e for e in SCENARIOS[SCENARIO].entries if e.label == label)


def _tune(matrix: Matrix, label: str) -> dict:
    """The row's whole search stored, its defaults at lr 0.03 the best: its tuned config."""
    grid = protocol.learning_rate_stage()
    grid += protocol.settings_stage(_entry(label).method, 0.03)
    for config in grid:
        accuracy = 0.9 if config == {"lr": 0.03} else 0.1
        _store(matrix, SCENARIO, _entry(label), config, [accuracy] * 2)
    return {"lr": 0.03}


def _store_private(matrix: Matrix, label: str, config: dict, z: float, seed: int,
                   accuracy: float | None, epsilon: float) -> None:
    """A privacy cell as ``Matrix.cell`` stores it (``accuracy`` None: it diverged)."""
    change = {**config, **protocol.privacy_change(z)}
    _store(matrix, SCENARIO, _entry(label), change, [accuracy or 0.0] * 2, stage="privacy",
           seed=seed)
    path = protocol.cell_path(matrix.out, SCENARIO, label, "privacy", change, seed)
    cell = json.loads(path.read_text())
    cell["privacy"] = {"epsilon": epsilon, "delta": 0.3}  # a diverged run spent it too
    if accuracy is None:
        cell.update(status="diverged", reason="no valid reply: losses not finite")
    if accuracy is None:
        del cell["accuracy_per_round"]
    path.write_text(json.dumps(cell))


def test_privacy_cells_are_compared_with_the_references_at_the_same_noise(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1, 2))
    monkeypatch.setattr(protocol, "PRIVACY", [
        protocol.Ablation(SCENARIO, label, protocol.privacy_change(0.1), "")
        for label in ("fedavg", "fedper", "feddecomp")] + [
        protocol.Ablation(SCENARIO, label, protocol.privacy_change(1.0), "")
        for label in ("fedavg", "fedper")])
    matrix = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    accuracies = {"fedavg": (0.50, 0.60), "fedper": (0.70, 0.70), "feddecomp": (0.60, None)}
    for label, private in accuracies.items():
        config = _tune(matrix, label)
        for seed, accuracy in zip((1, 2), private, strict=True):
            _store(matrix, SCENARIO, _entry(label), config, [0.9] * 2, stage="report", seed=seed)
            _store_private(matrix, label, config, 0.1, seed, accuracy, epsilon=40.0 + seed)
            if label != "feddecomp":  # at 1.0 FedAvg diverged on both seeds, FedPer did not
                _store_private(matrix, label, config, 1.0, seed,  # diverged: stopped early
                               None if label == "fedavg" else 0.3,
                               epsilon=2.0 if label == "fedavg" else 4.0)

    stats = privacy_stats(matrix)[SCENARIO]
    assert stats["fedavg"]["levels"][0.1]["epsilon"] == 42.0  # every run's guarantee: the most
    assert stats["feddecomp"]["levels"][0.1]["diverged"] == [2]
    assert stats["feddecomp"]["levels"][0.1]["epsilon"] == 42.0  # spent by the diverged seed
    tables = privacy_tables({SCENARIO: stats})
    assert "z = 0.1 (ε ≤ 42)" in tables
    # FedPer minus FedAvg, seed by seed: +20 and +10 points
    assert "| fedper | 0.1 | +15.0 [" in tables
    # against itself without DP (0.9 on both seeds): -20 and -20 points, no spread
    assert "| fedper | 0.1 | +15.0 [-48.5, +78.5] | - | -20.0 [-20.0, -20.0] |" in tables
    assert "| feddecomp | 90.0 ± 0.0 | 60.0 ± 0.0, 1 diverged |" in tables
    # its seed 2 diverged: compared on seed 1 alone, and said so
    assert ("| feddecomp | 0.1 | +10.0 (seeds 1 only) | -10.0 (seeds 1 only) | -30.0 (seeds 1 "
            "only) |") in tables

    # a level's epsilon is the most any row spent at it (FedAvg stopped early, spending less)
    assert level_epsilons(stats) == {0.1: 42.0, 1.0: 4.0} and "z = 1.0 (ε ≤ 4)" in tables
    # a side that diverged on every seed is named, not left blank
    assert "| fedavg | 1.0 | - | diverged | diverged |" in tables
    assert "| fedper | 1.0 | fedavg diverged | - | -60.0 [-60.0, -60.0] |" in tables

    report = write_report(matrix, "python bench/matrix.py")
    assert "## Differential privacy" in report
    assert (tmp_path / "matrix" / f"privacy-{SCENARIO}.png").stat().st_size > 0
    summary = json.loads((tmp_path / "matrix" / "summary.json").read_text())["privacy"]
    level = summary["rows"][f"{SCENARIO}/fedper"]["levels"]["0.1"]
    assert level["vs"]["fedavg"]["paired_diffs"] == pytest.approx([0.2, 0.1])
    assert summary["mode"] == "local" and summary["clip_norm"] == protocol.PRIVACY_CLIP_NORM


def test_a_privacy_cell_waits_for_its_row_to_be_tuned(tmp_path):
    entry = protocol.Ablation(SCENARIO, "fedper", protocol.privacy_change(0.1), "")
    assert Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3).privacy(entry) == ([], [])


@pytest.mark.integration
def test_a_privacy_cell_runs_the_rows_tuned_configuration_under_local_dp(federation, tmp_path,
                                                                         monkeypatch):
    """The tuning cells are written here; the privacy cell is a real run."""
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1,))
    entry = protocol.Ablation(SCENARIO, "fedper", protocol.privacy_change(0.01), "")
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    config = _tune(offline, "fedper")

    [cell], clean = Matrix(federation, COMMON_DIGITS, tmp_path, num_clients=3).privacy(entry)
    assert clean == []  # the row's report seed without DP has not run
    assert cell["stage"] == "privacy" and cell["config"] == {**config, **entry.change}
    assert cell["run_config"]["num-server-rounds"] == COMMON_DIGITS["num-server-rounds"]
    assert cell["run_config"]["dp.mode"] == "local"
    assert cell["privacy"]["epsilon"] > 0 and cell["privacy"]["noise_multiplier"] == 0.01
    assert offline.privacy(entry) == ([cell], [])  # stored: not run again
