"""Which cells the evidence matrix reads for an ablation and a privacy level, which rows a
``--only`` names, and which diverged runs it keeps (``bench/evidence/cells.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.evidence import protocol
from bench.evidence.cells import Matrix, run, select
from bench.evidence.protocol import SCENARIOS
from bench.evidence.report import write_report
from bench.evidence.stats import ablation_stats, row_stats
from bench.evidence.tables import ablation_table
from common.protocol import NOT_FINITE
from launch.federation import FlowerRun
from tests.conftest import ROOT
from tests.test_matrix import COMMON_DIGITS, _store, _tuned_fedavg, only_rows

SCENARIO = "dirichlet-0.1"


def _report(matrix: Matrix, item, config: dict, seeds, rising: float = 0.0,
            stage: str = "report") -> None:
    for seed in seeds:
        _store(matrix, SCENARIO, item, config, [0.5 + rising * r for r in range(2)],
               stage=stage, seed=seed)


def test_an_ablation_is_its_rows_reported_configuration_with_its_change_winning(
        tmp_path, capsys, monkeypatch):
    """On the exploratory seeds, at the scenario's rounds; the change replaces a key the
    configuration sets (here the learning rate itself)."""
    only_rows(monkeypatch, "fedavg")
    offline, item, tuned = _tuned_fedavg(tmp_path)
    probe = protocol.Ablation(SCENARIO, "fedavg", {"lr": 0.5}, "")
    changed = {**tuned, "lr": 0.5}
    _report(offline, item, changed, protocol.REPORT_SEEDS, stage="ablation")
    cells = offline.ablation(probe, may_run=False)
    assert [c["seed"] for c in cells] == list(protocol.exploratory_seeds()) == [1, 2, 4, 5, 6]
    assert all(c["config"] == changed for c in cells)

    untuned = Matrix(None, COMMON_DIGITS, tmp_path / "other", num_clients=3)
    assert untuned.ablation(probe) == []
    assert "dirichlet-0.1/fedavg lr=0.5: not tuned yet; no ablation" in capsys.readouterr().err


def test_an_ablation_waits_for_its_scenarios_rounds_and_skips_a_change_the_row_has(
        tmp_path, capsys, monkeypatch):
    """Before every row of its scenario is tuned its rounds are not fixed; a change that
    leaves the row's run as it is (its own learning rate; a default it runs anyway) would
    repeat the row's cells under another name."""
    only_rows(monkeypatch, "fedavg", "local")
    offline, item, tuned = _tuned_fedavg(tmp_path)
    probe = protocol.Ablation(SCENARIO, "fedavg", {"lr": 0.5}, "")
    assert offline.ablation(probe) == []
    assert ("dirichlet-0.1/fedavg lr=0.5: its scenario's rounds are not fixed yet; no "
            "ablation" in capsys.readouterr().err)
    only_rows(monkeypatch, "fedavg")
    _report(offline, item, tuned, protocol.REPORT_SEEDS)
    same = [protocol.Ablation(SCENARIO, "fedavg", change, "")
            for change in ({"lr": tuned["lr"]}, {"local-epochs": COMMON_DIGITS["local-epochs"]})]
    for ablation in same:
        assert offline.ablation(ablation) == [] and offline.redundant(ablation)
        assert "already has this change" in capsys.readouterr().err
    assert not offline.redundant(probe)
    # the report lists it as not run
    monkeypatch.setattr(protocol, "ABLATIONS", same[:1])
    assert ("| dirichlet-0.1/fedavg | lr=0.1 |  | - | not run: the row's tuned configuration "
            "already has this change |" in write_report(offline, "python bench/matrix.py"))


class _FailingFederation:
    """Every run crashes before it writes a result; the output folders it was asked for are
    kept in ``asked``."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.gpu_shares: set[float] = set()

    def run(self, app: Path, run_config: dict, num_supernodes: int, gpus_per_client: float,
            timeout: float) -> FlowerRun:
        self.asked.append(Path(run_config["output-dir"]).name)
        self.gpu_shares.add(gpus_per_client)
        return FlowerRun(1, "Traceback: boom", "1", "finished:failed", "boom")


def test_a_row_whose_search_failed_runs_no_report_seed_on_its_defaults(tmp_path, capsys):
    federation = _FailingFederation()
    matrix = Matrix(federation, COMMON_DIGITS, tmp_path, num_clients=3)
    row = select([SCENARIO], ["fedavg"])
    run(matrix, row, "all")
    assert len(federation.asked) == len(protocol.LR_GRID)
    assert all(name.startswith("tune-lr=") for name in federation.asked)
    assert "its search did not complete" in capsys.readouterr().err
    run(matrix, row, "report")  # asked for: its defaults at the base rounds, each report seed
    assert federation.asked[len(protocol.LR_GRID):] == [
        f"report-defaults-seed{seed}" for seed in protocol.REPORT_SEEDS]


def test_cells_on_cuda_give_every_client_a_share_that_fits_one_gpu(tmp_path):
    """``bench/matrix.py --device cuda`` (the device in the matrix's common settings): without a
    share Ray hides the GPU from a simulated client, which then refuses ``device=cuda``; with
    one CPU a client, as many clients as CPUs fit on one GPU at once. On the CPU no share."""
    for device in ("cuda", "cpu"):
        federation = _FailingFederation()
        matrix = Matrix(federation, {**COMMON_DIGITS, "device": device}, tmp_path / device,
                        num_clients=3)
        run(matrix, select([SCENARIO], ["fedavg"]), "tune")
        [share] = federation.gpu_shares
        if device == "cuda":
            assert share * (os.cpu_count() or 1) == pytest.approx(1)
        else:
            assert share == 0


def test_an_ablations_shorthand_rank_replaces_the_rank_its_row_chose(tmp_path, monkeypatch):
    """FedDecomp's row chose a conv rank of 0.3; ``feddecomp.rank = 1.0`` is full rank in
    every layer: the cell it reads is the one stored under the row's rate and that rank."""
    only_rows(monkeypatch, "feddecomp")
    offline = Matrix(None, COMMON_DIGITS, tmp_path, num_clients=3)
    item = next(e for e in SCENARIOS[SCENARIO].entries if e.label == "feddecomp")
    best = {"lr": 0.03, "feddecomp.rank-conv": 0.3}
    grid = protocol.learning_rate_stage() + protocol.settings_stage("feddecomp", 0.03)
    for config in grid:
        _store(offline, SCENARIO, item, config,
               [0.9 if config == best else 0.5 if config == {"lr": 0.03} else 0.1] * 2)
    _report(offline, item, best, protocol.REPORT_SEEDS)
    full = {"lr": 0.03, "feddecomp.rank": 1.0}
    _report(offline, item, full, protocol.REPORT_SEEDS, stage="ablation")
    probe = protocol.Ablation(SCENARIO, "feddecomp", {"feddecomp.rank": 1.0}, "")
    cells = offline.ablation(probe, may_run=False)
    assert [c["config"] for c in cells] == [full] * protocol.EXPLORATORY_SEEDS
    assert all(c["run_config"]["feddecomp.rank-conv"] == 1.0 for c in cells)


def test_a_privacy_level_runs_at_the_base_rounds_against_the_report_cells_read_there(
        tmp_path, monkeypatch):
    """Every row spends the same epsilon at a noise level: its privacy cells run the tuned
    configuration at the scenario's base rounds, on the exploratory seeds, and are compared
    with its report cells there: the first rounds of its runs at the scenario's rounds (here
    doubled, the row still rising on validation at the base)."""
    only_rows(monkeypatch, "fedavg")
    offline, item, tuned = _tuned_fedavg(tmp_path)
    _store(offline, SCENARIO, item, tuned, [0.5, 0.6])  # its chosen tuning run: rising
    _store(offline, SCENARIO, item, {**tuned, "num-server-rounds": 4}, [0.5] * 4)
    assert offline.reported(SCENARIO, item)[0] == {**tuned, "num-server-rounds": 4}
    longer = {**tuned, "num-server-rounds": 4}
    for seed in protocol.REPORT_SEEDS:
        _store(offline, SCENARIO, item, longer, [0.1, 0.2, 0.3, 0.4], stage="report", seed=seed)
    level = protocol.Ablation(SCENARIO, "fedavg", protocol.privacy_change(1.0), "")
    _report(offline, item, {**tuned, **level.change}, protocol.REPORT_SEEDS, stage="privacy")
    private, clean = offline.privacy(level, may_run=False)
    assert [c["config"] for c in private] == [{**tuned, **level.change}] * 5
    assert [c["config"] for c in clean] == [longer] * 5
    assert all(c["accuracy_per_round"] == [0.1, 0.2] and c["read_at_rounds"] == 2
               for c in clean)

    untuned = Matrix(None, COMMON_DIGITS, tmp_path / "other", num_clients=3)
    assert untuned.privacy(level) == ([], [])


def test_only_names_rows_by_label_method_or_scenario_and_label():
    labels = [e.label for _, e in select([SCENARIO], ["fedfac"])]
    assert labels == ["fedfac", "fedfac@dynamic"]  # both rows of the method
    assert [e.label for _, e in select([SCENARIO], ["fedfac@dynamic"])] == ["fedfac@dynamic"]
    assert [(s, e.label) for s, e in select([SCENARIO, "cross-device"],
                                            ["cross-device/fedper"])] == [("cross-device",
                                                                           "fedper")]


class _DivergingFederation:
    """Every run ends as a diverged one does: failed, no reply with finite values left."""

    def run(self, app: Path, run_config: dict, num_supernodes: int, gpus_per_client: float,
            timeout: float) -> FlowerRun:
        out = Path(run_config["output-dir"])
        out.mkdir(parents=True, exist_ok=True)
        reason = f"round 2: no valid train reply (3 dropped: loss {NOT_FINITE})"
        (out / "results.json").write_text(json.dumps({"status": "failed", "reason": reason,
                                                      "rounds": []}))
        return FlowerRun(0, "", "1", "finished:failed", reason)


def test_a_diverged_run_is_a_result_at_every_stage(tmp_path):
    """Under DP noise, at a searched learning rate, with an ablation's change or at a
    configuration chosen on another scenario, diverging is what the configuration does: a run
    here is the same run again, so running it again would only diverge again."""
    matrix = Matrix(_DivergingFederation(), COMMON_DIGITS, tmp_path, num_clients=3)
    item = next(e for e in SCENARIOS[SCENARIO].entries if e.label == "fedavg")
    for stage in ("tune", "privacy", "report", "ablation"):
        cell = matrix.cell(SCENARIO, item, stage, {"lr": 0.3}, 1)
        assert cell["status"] == "diverged", stage
        assert protocol.cell_path(tmp_path, SCENARIO, "fedavg", stage, {"lr": 0.3}, 1).exists()


def test_a_row_that_diverged_on_a_report_seed_is_reported_naming_it(tmp_path, monkeypatch):
    """Its figures are over the seeds that finished, the report names the seed; diverged on
    every seed, it is named, not listed as not run."""
    only_rows(monkeypatch, "fedavg", "fedper")
    offline, item, tuned = _tuned_fedavg(tmp_path)
    *finished, last = protocol.REPORT_SEEDS
    _report(offline, item, tuned, finished, rising=0.01)
    diverging = Matrix(_DivergingFederation(), COMMON_DIGITS, tmp_path, num_clients=3)
    diverging.cell(SCENARIO, item, "report", tuned, last)

    row = row_stats(offline, SCENARIO, item)
    assert (row["seeds"], row["diverged_seeds"], sorted(row["per_seed"])) == (
        len(finished), [last], finished)
    assert row["unstable_seeds"] == [last] and row["unstable_why"] == {last: "diverged"}
    report = write_report(offline, "test")
    # its 2 rounds read on round 2 (round 1 is the first quarter): 0.5 + 0.01
    assert f"| {len(finished)}, diverged on seed {last} | 51.0 ± 0.0 |" in report
    assert f"- {SCENARIO}/fedavg (lr={tuned['lr']}, 2 rounds): seed {last} diverged\n" in report
    summary = json.loads((tmp_path / "matrix" / "summary.json").read_text())
    assert summary["rows"][f"{SCENARIO}/fedavg"]["diverged_seeds"] == [last]
    assert summary["rows"][f"{SCENARIO}/fedavg"]["unstable_seeds"] == [last]

    for seed in finished:  # every seed diverged
        protocol.cell_path(tmp_path, SCENARIO, "fedavg", "report", tuned, seed).unlink()
        diverging.cell(SCENARIO, item, "report", tuned, seed)
    report = write_report(offline, "test")
    assert f"- {SCENARIO}/fedavg (lr={tuned['lr']}, 2 rounds): seed 1 diverged; seed 2" \
        in report
    not_run = report.split("## Not run yet\n\n")[1].split("\n\n")[0].split(", ")
    assert f"{SCENARIO}/fedavg" not in not_run and f"{SCENARIO}/fedper" in not_run


def test_an_ablation_that_diverged_on_a_seed_is_judged_on_the_others_and_names_it(
        tmp_path, monkeypatch):
    """The seed it diverged on is said, and the paired difference is over the seeds that
    finished; diverged on every seed, it has no figure."""
    only_rows(monkeypatch, "fedavg")
    offline, item, tuned = _tuned_fedavg(tmp_path)
    probe = protocol.Ablation(SCENARIO, "fedavg", {"lr": 0.5}, "why?")
    monkeypatch.setattr(protocol, "ABLATIONS", [probe])
    _report(offline, item, tuned, protocol.REPORT_SEEDS)  # flat at 0.5: converged
    changed = {**tuned, "lr": 0.5}
    *finished, last = protocol.exploratory_seeds()
    for seed in finished:
        _store(offline, SCENARIO, item, changed, [0.6, 0.6], stage="ablation", seed=seed)
    diverging = Matrix(_DivergingFederation(), COMMON_DIGITS, tmp_path, num_clients=3)
    assert diverging.cell(SCENARIO, item, "ablation", changed, last)["status"] == "diverged"

    stats = {SCENARIO: {"fedavg": row_stats(offline, SCENARIO, item)}}
    [result] = ablation_stats(offline, stats).values()
    assert (result["seeds"], result["diverged_seeds"]) == (len(finished), [last])
    assert sorted(result["per_seed"]) == finished
    line = ablation_table({("k",): result}, []).splitlines()[-1]
    assert f"| {len(finished)}, diverged on seed {last} | 60.0 ± 0.0 |" in line
    assert line.endswith("| +10.0 [+10.0, +10.0] |")  # over the seeds that finished

    for seed in finished:  # every seed diverged
        protocol.cell_path(tmp_path, SCENARIO, "fedavg", "ablation", changed, seed).unlink()
        diverging.cell(SCENARIO, item, "ablation", changed, seed)
    [result] = ablation_stats(offline, stats).values()
    assert (result["seeds"], result["accuracy"]) == (0, None)
    line = ablation_table({("k",): result}, []).splitlines()[-1]
    every = ", ".join(map(str, protocol.exploratory_seeds()))
    assert f"| 0, diverged on seeds {every} | diverged on every seed |  | 50.0 | no common " \
           "seed |" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_the_matrix_on_cuda_without_a_gpu_stops_before_any_run():
    done = subprocess.run([sys.executable, "bench/matrix.py", "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--device cuda: no CUDA device is visible on this machine")
