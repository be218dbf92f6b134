"""Protocol v4's cells (bench/evidence/cells.py, rounds.py, bench/matrix.py): one round count a
scenario, fixed on the tuning runs' validation curves before any report seed runs; every row
at it on every report seed, read at the base rounds too; v3's cells taken over where their run
is unchanged; mu's density carried by a Factorized-FL cell; v4 kept apart from v3; a stored
cell replayed as it ran (bench/reproduce.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.evidence import protocol
from bench.evidence.cells import Matrix, run, select
from bench.evidence.protocol import SCENARIOS
from bench.evidence.report import write_report
from bench.evidence.rounds import prefix
from bench.evidence.stats import row_stats
from bench.report import RESULTS
from launch.federation import FlowerRun
from tests.test_matrix import COMMON_DIGITS, _store, only_rows

SCENARIO = "dirichlet-0.1"
MB = 1024**2


class _CurveFederation:
    """Every run completes with the curve ``curve(run_config)`` gives it (a tuning run's on
    validation), written as the app writes results.json (the parts a cell reads); the output
    folders asked for are kept in ``asked``, the last run's config and number of SuperNodes in
    ``last``; ``final``: more of results.json's ``final``."""

    def __init__(self, curve, final: dict | None = None) -> None:
        self.curve, self.final, self.asked = curve, final or {}, []
        self.last: tuple[dict, int] | None = None

    def run(self, app: Path, run_config: dict, num_supernodes: int, gpus_per_client: float,
            timeout: float) -> FlowerRun:
        out = Path(run_config["output-dir"])
        out.mkdir(parents=True, exist_ok=True)
        self.asked.append(out.name)
        self.last = (run_config, num_supernodes)
        curve = self.curve(run_config)
        rounds = [{"round": r, "bytes_up": MB, "eval": {
            "accuracy_weighted": a, "accuracy_min": a, "accuracy_mean": a}}
            for r, a in enumerate(curve, 1)]
        (out / "results.json").write_text(json.dumps({
            "status": "completed", "rounds": rounds,
            "evaluated_on": "validation" if run_config.get("validation-fraction") else "test",
            "final": {"accuracy_weighted": curve[-1], "accuracy_mean": curve[-1],
                      "accuracy_min": curve[-1], "bytes_up_total": len(curve) * MB,
                      "seconds_total": 1.0, **self.final}}))
        return FlowerRun(0, "", "1", "finished:completed")


def _curve(run_config: dict) -> list[float]:
    """lr 0.03 best on validation; Local's chosen run still rising at the base rounds (2),
    flat at 4; every report run rising fast (which decides nothing)."""
    n = run_config["num-server-rounds"]
    if not run_config.get("validation-fraction"):
        return [0.3 + 0.1 * r for r in range(n)]
    level = 0.5 if run_config["lr"] == 0.03 else 0.1
    if run_config["method"] == "local" and n == 2:
        return [level - 0.1, level]
    return [level] * n


def test_rounds_are_fixed_on_validation_before_any_report_seed_and_every_row_runs_them(
        tmp_path, monkeypatch):
    only_rows(monkeypatch, "fedavg", "local")
    federation = _CurveFederation(_curve)
    matrix = Matrix(federation, COMMON_DIGITS, tmp_path, num_clients=3)
    rows = select([SCENARIO], ["fedavg", "local"])
    run(matrix, rows, "tune")  # the searches, then the rounds: no report seed
    searches = 2 * (len(protocol.LR_GRID) + protocol.EXTRA_CONFIGS)
    assert all(name.startswith("tune-") for name in federation.asked)
    # Local still rising on validation at 2 rounds: every row's chosen run at 4, once
    assert federation.asked[searches:] == ["tune-lr=0.03+num-server-rounds=4-seed0"] * 2
    assert matrix.rounds(SCENARIO) == 4
    run(matrix, rows, "all")  # resumes: the report seeds at 4 rounds, every row
    assert federation.asked[searches + 2:] == [
        f"report-lr=0.03+num-server-rounds=4-seed{seed}"
        for _ in range(2) for seed in protocol.REPORT_SEEDS]
    # the report seeds still rise fast at 4 rounds: nothing is doubled on them
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    assert offline.rounds(SCENARIO) == 4
    assert {offline.reported(SCENARIO, item)[0]["num-server-rounds"] for _, item in rows} == {4}

    write_report(offline, "test")
    summary = json.loads((tmp_path / "matrix" / "summary.json").read_text())
    assert summary["protocol"]["version"] == 4
    assert summary["protocol"]["rounds_chosen_on"] == "validation"
    rounds = summary["protocol"]["rounds"][SCENARIO]
    assert (rounds["rounds"], rounds["base_rounds"], rounds["rounds_chosen_on"]) == (
        4, 2, "validation")
    assert rounds["validation_slopes"]["2"]["local"] == pytest.approx(0.1)
    assert rounds["validation_slopes"]["4"] == pytest.approx({"fedavg": 0.0, "local": 0.0})
    fedavg, local = (summary["rows"][f"{SCENARIO}/{label}"] for label in ("fedavg", "local"))
    assert fedavg["rounds"] == local["rounds"] == 4
    assert fedavg["local_epochs"] == local["local_epochs"] == COMMON_DIGITS["local-epochs"]
    assert fedavg["unstable_seeds"] == [] and fedavg["mb_up_per_round"] == pytest.approx(1.0)
    # read at the base rounds too, on the same runs' first 2 rounds (round 2: 0.4)
    assert fedavg["at_base_rounds"]["rounds"] == 2
    assert fedavg["at_base_rounds"]["mean"] == pytest.approx(0.4)
    assert fedavg["validation"] == {"accuracy": 0.5}
    assert set(summary["pick"][SCENARIO]) >= {"run", "also", "avoid"}


def test_the_rounds_stop_at_the_last_doubling_and_a_diverged_tuning_run_is_settled(
        tmp_path, monkeypatch):
    only_rows(monkeypatch, "fedavg", "local")
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    items = {e.label: e for e in SCENARIOS[SCENARIO].entries}
    for label in items:
        for k, config in enumerate(protocol.learning_rate_stage()
                                   + protocol.settings_stage(label, 0.03)):
            _store(offline, SCENARIO, items[label], config, [0.5 if k == 3 else 0.1] * 2)
    assert offline.rounds(SCENARIO) == 2  # flat: the base rounds, no longer run needed
    rising = Matrix(None, COMMON_DIGITS, tmp_path / "rising", num_clients=3)
    for label in items:
        for k, config in enumerate(protocol.learning_rate_stage()
                                   + protocol.settings_stage(label, 0.03)):
            _store(rising, SCENARIO, items[label], config, [0.4, 0.5] if k == 3 else [0.1] * 2)
    assert rising.rounds(SCENARIO) is None  # the 4-round runs are missing
    for label in items:
        _store(rising, SCENARIO, items[label], {"lr": 0.03, "num-server-rounds": 4},
               [0.1, 0.2, 0.3, 0.4])
    assert rising.rounds(SCENARIO) is None  # still rising: 8 next
    _store(rising, SCENARIO, items["fedavg"], {"lr": 0.03, "num-server-rounds": 8},
           [0.1 * r for r in range(8)])
    assert rising.rounds(SCENARIO) is None
    path = protocol.cell_path(rising.out, SCENARIO, "local", "tune",
                              {"lr": 0.03, "num-server-rounds": 8}, 0)
    _store(rising, SCENARIO, items["local"], {"lr": 0.03, "num-server-rounds": 8}, [])
    cell = {**json.loads(path.read_text()), "status": "diverged", "reason": "round 5: ..."}
    del cell["accuracy_per_round"]
    path.write_text(json.dumps(cell))
    assert protocol.MAX_DOUBLINGS == 2
    assert rising.rounds(SCENARIO) == 8  # the last doubling, still rising or diverged there
    assert rising.validation(SCENARIO, items["local"]) is None  # no figure to choose by


def test_a_v3_cell_of_the_same_run_is_taken_over_and_no_other(tmp_path, monkeypatch):
    """Same resolved configuration, rounds, data and number of clients: copied, marked; run
    under another configuration (v3's ten local epochs) or a privacy cell: not."""
    only_rows(monkeypatch, "fedavg")
    item = next(e for e in SCENARIOS[SCENARIO].entries if e.label == "fedavg")
    v3 = Matrix(None, COMMON_DIGITS, tmp_path / "v3", num_clients=3)
    _store(v3, SCENARIO, item, {"lr": 0.03}, [0.5] * 2)
    _store(v3, SCENARIO, item, {"lr": 0.03}, [0.5] * 2, stage="privacy", seed=1)
    other = Matrix(None, {**COMMON_DIGITS, "local-epochs": 10}, tmp_path / "v3", num_clients=3)
    _store(other, SCENARIO, item, {"lr": 0.01}, [0.5] * 2)
    v4 = Matrix(None, COMMON_DIGITS, tmp_path / "v4", num_clients=3, reuse=tmp_path / "v3")
    cell = v4.cell(SCENARIO, item, "tune", {"lr": 0.03}, 0, may_run=False)
    assert cell["reused_from"] == "matrix/cells/dirichlet-0.1/fedavg/tune-lr=0.03-seed0.json"
    assert protocol.cell_path(tmp_path / "v4", SCENARIO, "fedavg", "tune", {"lr": 0.03},
                              0).exists()
    assert v4.cell(SCENARIO, item, "tune", {"lr": 0.01}, 0, may_run=False) is None
    assert v4.cell(SCENARIO, item, "privacy", {"lr": 0.03}, 1, may_run=False) is None


def test_a_run_read_at_fewer_rounds_is_its_prefix():
    """Every 10th round evaluated and the last ten (cross-device): its prefix at 80 rounds has
    rounds 10-80; uplink over its first 80 rounds."""
    rounds = [*range(10, 160, 10), *range(151, 161)]
    cell = {"run_config": {"num-server-rounds": 160}, "rounds": rounds,
            "accuracy_per_round": [r / 1000 for r in rounds], "mb_up_per_round": [1.0] * 160,
            "mb_up_total": 160.0, "seconds_total": 320.0}
    short = prefix(cell, 80)
    assert short["rounds"] == list(range(10, 90, 10)) and short["accuracy_per_round"][-1] == 0.08
    assert (short["mb_up_total"], short["seconds_total"], short["read_at_rounds"]) == (
        80.0, 160.0, 80)
    assert prefix(cell, 160) is cell and prefix({**cell, "status": "diverged"}, 80)["rounds"] \
        == rounds


def test_a_factorized_fl_cell_carries_mus_density_where_the_run_recorded_it(tmp_path,
                                                                           monkeypatch,
                                                                           capsys):
    scenario = "permuted-labels"
    only_rows(monkeypatch, "factorized-fl", scenario=scenario)
    monkeypatch.setattr(protocol, "REPORT_SEEDS", (1, 2))
    rows = select([scenario], ["factorized-fl"])
    for folder, final in (("recorded", {"mu_density": 0.25}), ("not", {})):
        matrix = Matrix(_CurveFederation(_curve, final), COMMON_DIGITS, tmp_path / folder,
                        num_clients=3)
        run(matrix, rows, "all")
        row = row_stats(matrix, scenario, rows[0][1])
        assert row["num_rounds"] == 2 and row["seeds"] == 2
        if final:
            assert row["mu_density"] == 0.25 and "mu_density_missing" not in row
        else:
            assert row["mu_density"] is None and "before the app" in row["mu_density_missing"]
            assert "no mu density recorded (its run's results.json" in capsys.readouterr().err


def test_a_factorized_fl_report_cell_is_run_here_for_its_density_even_where_a_cell_exists(
        tmp_path, monkeypatch):
    """v3's report cell of the same run has no density: not taken over (its tuning cell is);
    a stored cell no longer current runs again and gets its density too."""
    scenario = "permuted-labels"
    only_rows(monkeypatch, "factorized-fl", scenario=scenario)
    item = SCENARIOS[scenario].entries[0]
    v3 = Matrix(None, COMMON_DIGITS, tmp_path / "v3", num_clients=3)
    _store(v3, scenario, item, {"lr": 0.03}, [0.5] * 2)
    _store(v3, scenario, item, {"lr": 0.03}, [0.5] * 2, stage="report", seed=1)
    # a cell stored under another local-epochs, where v4 stores it: not current
    _store(Matrix(None, {**COMMON_DIGITS, "local-epochs": 10}, tmp_path / "v4", num_clients=3),
           scenario, item, {"lr": 0.03}, [0.5] * 2, stage="report", seed=2)
    v4 = Matrix(_CurveFederation(_curve, {"mu_density": 0.25}), COMMON_DIGITS, tmp_path / "v4",
                num_clients=3, reuse=tmp_path / "v3")
    assert "reused_from" in v4.cell(scenario, item, "tune", {"lr": 0.03}, 0)
    for seed in (1, 2):
        cell = v4.cell(scenario, item, "report", {"lr": 0.03}, seed)
        assert "reused_from" not in cell and cell["mu_density"] == 0.25, seed


def test_a_stored_cell_is_replayed_as_it_ran_and_what_today_would_change_is_named(tmp_path,
                                                                                 monkeypatch):
    """bench/reproduce.py's re-run of a cell stored before its row changed (v3's Factorized-FL
    ran the app's default mu-init, v4's row sets zeros): its own resolved config runs, on its
    own number of clients, not today's row; today's change is named (not a setting the app
    gained since, which the replay runs at today's default too); a replay is stored."""
    scenario = "permuted-labels"
    only_rows(monkeypatch, "factorized-fl", scenario=scenario)
    item = SCENARIOS[scenario].entries[0]
    federation = _CurveFederation(_curve)
    matrix = Matrix(federation, COMMON_DIGITS, tmp_path, num_clients=3)
    today = matrix.store.resolved(matrix.run_config(scenario, item, "report", {"lr": 0.03}, 1,
                                                    tmp_path))
    assert today["factorized-fl.mu-init"] == "zeros"
    # stored before the app had tuning-share: today's default replays it, no difference
    then = {k: v for k, v in today.items() if k != "tuning-share"}
    stored = {"scenario": scenario, "label": item.label, "stage": "report",
              "config": {"lr": 0.03}, "seed": 1, "num_clients": 2,
              "resolved_config": {**then, "factorized-fl.mu-init": "xavier"}}
    cell, differs = matrix.replay(stored)
    ran, supernodes = federation.last
    assert (ran["factorized-fl.mu-init"], supernodes) == ("xavier", 2)
    assert differs == "factorized-fl.mu-init=zeros"
    assert cell["num_clients"] == 2 and cell["accuracy_per_round"][0] == 0.3
    assert matrix.replay(stored) == (cell, differs) and len(federation.asked) == 1


def test_v4_is_written_apart_and_write_only_without_v4_cells_writes_nothing(tmp_path,
                                                                           monkeypatch):
    import bench.matrix as command

    assert command.OUT == RESULTS / "matrix-v4" and command.RUNS.is_relative_to(
        RESULTS / "matrix" / "runs")  # git ignores the runs' folders there
    published = (RESULTS / "report.md").read_bytes()
    written: list[Path] = []
    monkeypatch.setattr(command, "OUT", tmp_path / "matrix-v4")
    monkeypatch.setattr(command, "pool_file", lambda role="report": Path(f"/pools/{role}"))
    monkeypatch.setattr(command, "write_report",
                        lambda matrix, _: written.append(matrix.out) or "written")
    monkeypatch.setattr(sys, "argv", ["bench/matrix.py", "--write-only"])
    with pytest.raises(SystemExit, match="no protocol v4 cells under .*: no report written; "
                       r"v3's \(bench/results/report.md"):
        command.main()
    assert written == [] and (RESULTS / "report.md").read_bytes() == published
    cell = tmp_path / "matrix-v4" / "matrix" / "cells" / SCENARIO / "fedavg" / "x.json"
    cell.parent.mkdir(parents=True)
    cell.write_text("{}")
    command.main()
    assert written == [tmp_path / "matrix-v4"]


def test_every_tuning_and_report_seed_draws_a_partition_of_its_pool(tmp_path):
    """Checked before any run (skipped where the pools are not built): each scenario's
    tuning seed on the tuning pool (cross-device's seed 0 cannot give 100 clients 10 images
    each at Dirichlet 0.3, its seed 16 can) and every report seed on the report pool (seeds 3
    and 9-12 cannot there: v3's code redrew after a failed draw, today's refuses)."""
    from common.config import RunSettings
    from fldata import check_partition

    pools = {role: Path("~/.cache/pflower/bench").expanduser() / name for role, name in (
        ("report", "fashion-mnist-5000.npz"), ("tuning", "fashion-mnist-5000-tuning.npz"))}
    if not all(p.exists() for p in pools.values()):
        pytest.skip("the matrix's pools are not built here (python bench/matrix.py builds them)")
    matrix = Matrix(None, {**protocol.COMMON, "dataset": str(pools["report"])}, tmp_path,
                    tuning={**protocol.TUNING, "dataset": str(pools["tuning"])})
    for scenario, spec in SCENARIOS.items():
        assert spec.tuning_seed not in protocol.REPORT_SEEDS, scenario
        item = spec.entries[0]
        for stage, seeds in (("tune", [spec.tuning_seed]), ("report", protocol.REPORT_SEEDS)):
            for seed in seeds:
                run_config = matrix.run_config(scenario, item, stage, {}, seed, tmp_path)
                settings = RunSettings.from_run_config(matrix.store.resolved(run_config))
                check_partition(settings, spec.num_clients)  # raises where it cannot
