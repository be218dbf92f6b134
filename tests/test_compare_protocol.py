"""compare's protocol, on a federation whose runs are scripted (their figures chosen here, so
that a wrong choice shows): which runs it makes, what it chooses them on, which rows it
compares at which margin, what it warns about and how it exits. The real runs are in
test_compare.py's one comparison."""

from __future__ import annotations

import argparse
import json

import pytest

from launch.compare import main, seed_list
from tests.scripted_federation import ScriptedFederation


def _script(config: dict) -> float | None:
    """local's lr 0.1 wins on validation splits and loses on test splits (a choice made on
    test figures would take 0.01); fedprox is half a point below fedavg, steadily (not
    worse at a one-point margin, not better); fedper's tuning runs, fedbn's report runs and
    fedavg's seed 3 fail."""
    lr, seed, method = config.get("lr"), config["seed"], config["method"]
    tuning = "validation-fraction" in config
    if ((method == "fedper" and tuning) or (method == "fedbn" and not tuning)
            or (method == "fedavg" and seed == 3)):
        return None
    if tuning:
        return {0.1: 0.8, 0.01: 0.6}[lr]
    if method == "fedprox":
        return 0.695 + 0.0012 * seed
    return (0.70 if method == "fedavg" else 0.75 if lr == 0.1 else 0.95) + 0.001 * seed


def _curve(config: dict) -> list[float] | None:
    """A run has 2 rounds, its second at the accuracy ``_script`` gives (None: the run fails),
    and its first is the opposite of its second (1 - the accuracy): a figure, a choice or a
    printed line that read round 1, the first quarter of the run, would show it."""
    accuracy = _script(config)
    return None if accuracy is None else [1 - accuracy, accuracy]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare") / "out"
    federation = ScriptedFederation(_curve)
    argv = ["--methods",
            "fedavg,local:lr=0.01|0.1,fedper:lr=0.01|0.1,fedbn:lr=0.01|0.1,fedprox",
            "--seeds", "1,2,3",
            "--supernodes", "2", "--out", str(out), "num-server-rounds=2"]
    code = main(argv, federation=federation)
    return code, federation.runs, json.loads((out / "summary.json").read_text())


def test_tuning_runs_score_on_validation_splits_of_the_tuning_seed_and_reports_on_test(
        scripted):
    _, runs, summary = scripted
    tuning = [r for r in runs if "validation-fraction" in r]
    assert {(r["method"], r["lr"], r["seed"], r["validation-fraction"]) for r in tuning} == {
        (m, lr, 0, 0.2) for m in ("local", "fedper", "fedbn") for lr in (0.01, 0.1)}
    reports = [r for r in runs if "validation-fraction" not in r]
    assert sorted((r["method"], r["seed"]) for r in reports) == [
        (m, seed) for m in ("fedavg", "fedbn", "fedprox", "local") for seed in (1, 2, 3)]
    assert summary["rows"]["local"]["chosen"] == {"lr": 0.1}  # its validation figure's best
    assert {t["evaluated_on"] for t in summary["rows"]["local"]["tuning"]} == {"validation"}
    assert summary["rows"]["fedavg"]["tuning"] == []  # nothing to tune: no tuning run


def test_rows_are_compared_with_the_reference_at_the_margin_in_points(scripted):
    _, _, summary = scripted
    assert summary["protocol"]["margin"] == -0.01  # --margin -1 (points)
    assert "versus_reference" not in summary["rows"]["fedavg"]
    assert summary["rows"]["local"]["versus_reference"]["seeds"] == ["1", "2"]  # no fedavg 3
    assert summary["rows"]["fedprox"]["verdicts"] == {
        "verdict": "held", "superiority": "did not hold", "interval": "above the margin"}


def test_failed_runs_are_listed_rows_without_a_tuning_or_report_run_left_out_exit_1(
        scripted):
    code, _, summary = scripted
    assert code == 1 and list(summary["rows"]) == ["fedavg", "local", "fedprox"]
    assert sorted(f.split(":")[0] for f in summary["failed"]) == [
        "fedavg report defaults seed 3", *(f"fedbn report lr=0.1 seed {s}" for s in (1, 2, 3)),
        "fedper tune lr=0.01 seed 0", "fedper tune lr=0.1 seed 0"]


def test_unequal_budgets_are_said_before_anything_runs(tmp_path, capsys):
    federation = ScriptedFederation(_curve)
    main(["--methods", "fedavg,local:lr=0.01|0.1", "--seeds", "1", "--supernodes", "2",
          "--out", str(tmp_path / "out"), "num-server-rounds=2"], federation=federation)
    said = capsys.readouterr().out
    assert "[compare] unequal tuning budgets (fedavg 1, local 2)" in said
    assert said.index("unequal tuning budgets") < said.index("running")
    # so are short runs, once: 2 rounds are read on round 2 only
    assert said.count("[compare] short runs: a run of 2 rounds is read on round 2 (1 of its "
                      "2)") == 1
    assert said.index("short runs") < said.index("running")


def test_each_runs_line_shows_the_reports_figure_in_points(tmp_path, capsys):
    """The line a run prints as it ends reads the rounds the report reads (round 2 of 2),
    in points as the report: not its final round's fraction."""
    out = tmp_path / "out"
    main(["--methods", "fedavg,local:lr=0.01|0.1", "--seeds", "1,2", "--supernodes", "2",
          "--out", str(out), "num-server-rounds=2"], federation=ScriptedFederation(_curve))
    said = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    for seed in (1, 2):
        figure = summary["rows"]["fedavg"]["per_seed"][str(seed)]["accuracy"]
        assert figure == pytest.approx(0.70 + 0.001 * seed)  # round 2's, not round 1's
        assert (f"[compare] fedavg report defaults seed {seed}: accuracy {100 * figure:.1f}, "
                f"min client {100 * figure:.1f} (points, mean of round 2) ") in said
    assert ("[compare] local tune lr=0.1 seed 0: validation accuracy 80.0, min client 80.0 "
            "(points, mean of round 2)") in said
    record = json.loads((out / "runs" / "fedavg" / "report-defaults-seed1.json").read_text())
    assert record["accuracy_per_round"] == pytest.approx([0.299, 0.701])  # fractions
    assert record["units"]["accuracy"].startswith("fraction (0-1)")
    report = (out / "report.md").read_text()
    fedavg = summary["rows"]["fedavg"]["accuracy"]
    assert f"| {100 * fedavg[0]:.1f} ± {100 * fedavg[1]:.1f} |" in report


def test_summary_json_is_in_fractions_and_says_so_and_records_the_clients(scripted):
    _, _, summary = scripted
    assert summary["units"]["accuracy"].startswith("fraction (0-1)")
    assert "points" in summary["units"]["slope"]  # and what the report writes instead
    assert summary["protocol"]["clients"] == 2
    local = summary["rows"]["local"]
    assert local["window"] == {"1": [2], "2": [2], "3": [2]}
    assert local["per_seed"]["1"]["accuracy"] == pytest.approx(0.751)  # a fraction
    assert [t["window"] for t in local["tuning"]] == [[2], [2]]


def test_a_tuning_seed_among_the_report_seeds_is_refused_only_where_a_row_has_a_grid(
        tmp_path):
    federation = ScriptedFederation(_curve)
    assert main(["--methods", "fedavg,local", "--seeds", "0,1", "--supernodes", "2", "--out",
                 str(tmp_path / "out"), "num-server-rounds=2"], federation=federation) == 0
    assert [r["seed"] for r in federation.runs] == [0, 1, 0, 1]


def test_a_folder_of_runs_with_another_number_of_clients_is_refused(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "clients.json").write_text(json.dumps({"supernodes": 3}))
    assert main(["--methods", "fedavg", "--supernodes", "2", "--out",
                 str(tmp_path / "out")], federation=ScriptedFederation(_curve)) == 2
    assert "holds runs with 3 clients (another split of the data)" in capsys.readouterr().err


def test_seeds_are_distinct_integers():
    assert seed_list("3, 1") == [3, 1]
    for text in ("1,1", "", "a"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"integers|distinct seeds"):
            seed_list(text)


def test_tuning_runs_and_report_runs_partition_disjoint_parts_of_the_pool(tmp_path):
    """A comparison tunes on the pool's tuning part and reports on the rest: no example a
    tuning run is scored on (its clients' validation splits) or trains on is in any report
    seed's split, whatever the seeds. Each example of this pool is its own number."""
    import numpy as np

    from fldata import load_client_data
    from launch.app_project import app_defaults
    from launch.compare import Comparison, parse_row
    from launch.federation import LocalFederation
    from strategies.registry import load_settings
    from tests.conftest import ROOT

    pool = tmp_path / "pool.npz"
    np.savez(pool, x=np.arange(1200, dtype=np.float32).reshape(1200, 1), y=np.arange(1200) % 10)
    comparison = Comparison(None, ROOT, {"dataset": str(pool), "model": "mlp"}, tmp_path,
                            LocalFederation.federation_config(4, 1, 0.0), 60, 0.2)
    row = parse_row("fedavg", app_defaults(ROOT), [])

    def examples(stage: str, seed: int) -> tuple[set[float], set[float]]:
        settings = load_settings({**app_defaults(ROOT),
                                  **comparison.run_config(row, stage, {}, seed)})
        train, scored = set(), set()
        for pid in range(4):
            data = load_client_data(settings, pid, 4)
            train |= set(data.x_train.ravel().tolist())
            scored |= set(data.x_test.ravel().tolist())
        return train, scored

    tuned = examples("tune", 0)
    reports = [examples("report", seed) for seed in (1, 2, 3)]
    assert tuned[1] and all(report[1] for report in reports)
    for report in reports:
        assert not (tuned[0] | tuned[1]) & (report[0] | report[1])
    # a fifth of the pool tunes (tuning-share; a tuning run reads its clients' training
    # shares, 80% of it: their test splits are never loaded), the rest reports
    assert len(tuned[0] | tuned[1]) == 192
    assert len(reports[0][0] | reports[0][1]) == 960
