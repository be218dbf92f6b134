"""The compare command (launch/compare.py): its arguments, its runs and what it writes (the
statistics themselves: tests/test_compare_stats.py). One real comparison, 2 methods x 2 seeds
on digits with both trackers on, serves the tests that read it."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from comparison.stats import (
    last_rounds_mean,
)
from launch.app_project import app_defaults
from launch.compare import main, parse_row
from launch.processes import free_port, stop_process_groups
from tests.conftest import ROOT, read_mlflow_run, wait_for

ARGS = ["--methods", "fedavg,local:lr=0.01|0.1", "--seeds", "1,2", "--supernodes", "2",
        "num-server-rounds=2", "local-epochs=1", "tracking=tensorboard,mlflow"]


def test_a_row_is_a_method_its_overrides_and_the_grid_of_its_value_lists():
    defaults = app_defaults(ROOT)
    row = parse_row("fedprox@strong:fedprox.mu=0.1|1;momentum=0.5", defaults, [0.01, 0.05])
    assert (row.label, row.method) == ("fedprox@strong", "fedprox")
    assert row.grid == [{"fedprox.mu": mu, "momentum": 0.5, "lr": lr}
                        for mu in (0.1, 1.0) for lr in (0.01, 0.05)]
    # fedfac.layers is a string key: "0,1" stays the word the user wrote
    assert parse_row("fedfac:fedfac.layers=3|0", defaults, []).grid == [
        {"fedfac.layers": "3"}, {"fedfac.layers": "0"}]
    assert parse_row("fedavg:lr=0.1", defaults, [0.01, 0.05]).grid == [{"lr": 0.1}]


@pytest.mark.parametrize(("argv", "says"), [
    (["--methods", "fedavg,fedavg"], "a row label appears twice"),
    (["--methods", "fedavg,fedprox:fedprox.mu=0.1|1", "--seeds", "0,1"],
     "--tuning-seed 0 is a report seed"),
    (["--methods", "fedavg,fedpre"], "fedpre"),
    (["--methods", "fedavg", "--reference", "local"], "--reference: 'local' is not a row"),
    (["--methods", "fedavg", "seed=3"], "seed: set by the command"),
    (["--methods", "fedavg:lr"], "an entry's override is key=value"),
    (["--methods", ","], "name at least one method"),
    (["--methods", "fedavg", "fraction-evaluate=0"], "evaluates nothing to compare"),
    (["--methods", "fedavg", "--app", "/nonexistent"], "/nonexistent"),
    (["--methods", "fedavg@a/b"], "a row label holds no '/'"),
    (["--methods", "fedavg", "resume-from=x"], "resume-from: set by the command"),
    (["--methods", "fedavg", "--supernodes", "0"], "--supernodes: at least 1"),
    (["--methods", "fedavg", "--validation-fraction", "0.95"], "0.95 is out of range"),
    (["--methods", "fedavg", "--validation-fraction", "0"], "0.0 is out of range"),
    # rows compared with each other train the same rounds and local epochs
    (["--methods", "fedavg,fedper:local-epochs=3"], "local-epochs is the same for every row"),
    (["--methods", "fedavg:num-server-rounds=5|10"], "num-server-rounds is the same for every"),
    (["--methods", "fedavg,local:batch-size=8"], "batch-size is the same for every row"),
    # the split drawn for every seed before any run: 1,797 digits over 1,000 clients (at
    # least 0 each: min-partition-size is capped at half an even share)
    (["--methods", "fedavg", "--seeds", "1,2", "--supernodes", "1000"],
     "seed 1: partitioner: "),
])
def test_a_mistake_in_the_command_is_one_line_and_exit_2_before_anything_runs(
        argv, says, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compare: ") and says in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def compared(federation, tmp_path_factory):
    """The comparison, run from a folder outside the repository without --out; the
    repository's git status before and after; what it printed."""
    home = tmp_path_factory.mktemp("user-folder")
    status = ["git", "status", "--porcelain", "--untracked-files=all"]
    before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    printed = io.StringIO()
    with contextlib.chdir(home), contextlib.redirect_stdout(printed):
        code = main(ARGS, federation=federation)
    print(printed.getvalue())  # shown where a test fails
    assert code == 0
    after = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    (out,) = (home / "outputs").glob("compare-*")
    return out, before, after, printed.getvalue()


@pytest.mark.integration
def test_compare_runs_methods_over_seeds_and_reports_outside_the_repository(compared,
                                                                             federation):
    out, before, after, printed = compared
    assert before == after  # nothing written into the checkout
    assert not list((ROOT / "outputs").glob("compare-*"))
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["rows"]) == ["fedavg", "local"] and summary["failed"] == []
    chosen = summary["rows"]["local"]["chosen"]
    for label, row in summary["rows"].items():
        assert row["seeds"] == ["1", "2"]  # as JSON keys them
        tag = "defaults" if label == "fedavg" else f"lr={chosen['lr']}"
        for seed in (1, 2):
            results = json.loads(
                (out / "runs" / label / f"report-{tag}-seed{seed}" / "results.json")
                .read_text())
            assert results["config"]["seed"] == seed and results["method"] == label
            assert results["evaluated_on"] == "test"
            curve = [r["eval"]["accuracy_weighted"] for r in results["rounds"]]
            assert row["curves"][str(seed)] == curve and len(curve) == 2
            # 2 rounds: round 1 is the first quarter, so the figure is round 2's; the run's
            # printed line gives it in points, as the report
            figure = row["per_seed"][str(seed)]["accuracy"]
            assert row["window"][str(seed)] == [2] and figure == pytest.approx(curve[1])
            assert (f"[compare] {label} report {tag} seed {seed}: accuracy "
                    f"{100 * figure:.1f}, min client "
                    f"{100 * row['per_seed'][str(seed)]['accuracy_min']:.1f} "
                    "(points, mean of round 2) ") in printed
    # local's grid was tuned on seed 0, each configuration scored on validation splits only,
    # and the one with the higher validation figure kept
    tuned = {}
    for lr in (0.01, 0.1):
        results = json.loads((out / "runs" / "local" / f"tune-lr={lr}-seed0" / "results.json")
                             .read_text())
        assert results["evaluated_on"] == "validation"
        assert results["config"]["validation-fraction"] == 0.2
        tuned[lr] = last_rounds_mean([r["eval"]["accuracy_weighted"] for r in results["rounds"]])
    assert chosen == {"lr": max(tuned, key=tuned.get)}
    assert [t["evaluated_on"] for t in summary["rows"]["local"]["tuning"]] == ["validation"] * 2
    versus = summary["rows"]["local"]["versus_reference"]
    assert len(versus["paired_diffs"]) == 2 and versus["ci95"] is not None
    verdicts = summary["rows"]["local"]["verdicts"]
    assert verdicts["superiority"] == ("held" if versus["ci95"][0] > 0 else "did not hold")
    assert summary["protocol"]["budgets"] == {"fedavg": 1, "local": 2}
    report = (out / "report.md").read_text()
    assert "| fedavg | defaults (1) | 2 |" in report and "| reference |" in report
    assert f"{100 * versus['mean_diff']:+.1f} [" in report
    assert "**Unequal tuning budgets** (fedavg 1, local 2" in report
    # one unit throughout (points), the slope over the rounds that ran, and a warning that
    # two seeds cannot tell methods apart
    fedavg = summary["rows"]["fedavg"]
    assert (f"| {100 * fedavg['accuracy'][0]:.1f} ± {100 * fedavg['accuracy'][1]:.1f} | "
            in report)
    assert "over the last 2 rounds" in report and "last 10 rounds" not in report
    assert "**2 seeds only**" in report
    # which rounds, how many clients, the short runs said once before any run and in the
    # report; summary.json in fractions, labelled
    assert "2 clients (`--supernodes`: the data is split into 2 partitions" in report
    assert "mean of round 2 (a run's last 5 evaluated rounds, none in the first" in report
    assert "**Short runs**: a run of 2 rounds is read on round 2 (1 of its 2)" in report
    assert printed.count("[compare] short runs: a run of 2 rounds is read on round 2") == 1
    assert printed.index("[compare] short runs") < printed.index(": running")
    assert summary["units"]["accuracy"].startswith("fraction (0-1)")
    assert summary["protocol"]["clients"] == 2 and 0 < fedavg["accuracy"][0] < 1
    for plot in ("accuracy.png", "accuracy-vs-uplink.png"):
        assert (out / plot).stat().st_size > 0
    # run again into the same folder: every run is found, none is made again
    stamps = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("results.json")}
    assert main([*ARGS, "--out", str(out)], federation=federation) == 0
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    # another number of clients splits the data otherwise: refused, nothing run
    assert main([*ARGS, "--supernodes", "3", "--out", str(out)], federation=federation) == 2


@pytest.mark.integration
def test_tracking_writes_tensorboard_events_and_an_mlflow_run_equal_to_results(compared):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = compared[0] / "runs" / "fedavg" / "report-defaults-seed2"
    results = json.loads((run_dir / "results.json").read_text())
    accuracy = [r["eval"]["accuracy_weighted"] for r in results["rounds"]]
    lowest = [r["eval"]["accuracy_min"] for r in results["rounds"]]

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in ("accuracy/weighted", "accuracy/min", "bytes/up")}
    assert scalars["accuracy/weighted"] == [(r, pytest.approx(a, rel=1e-6))  # float32
                                            for r, a in enumerate(accuracy, 1)]
    assert [v for _, v in scalars["accuracy/min"]] == pytest.approx(lowest, rel=1e-6)
    assert [v for _, v in scalars["bytes/up"]] == [r["bytes_up"] for r in results["rounds"]]
    assert "accuracy/per_client" in events.Tags()["histograms"]

    client, run, artifacts = read_mlflow_run(run_dir)
    history = client.get_metric_history(run.info.run_id, "accuracy/weighted")
    assert [(m.step, m.value) for m in history] == list(enumerate(accuracy, 1))
    assert run.info.status == "FINISHED" and run.info.run_name == "fedavg-seed2"
    assert run.data.params["method"] == "fedavg" and run.data.params["seed"] == "2"
    assert json.loads((artifacts / "per_client" / "round-0002.json").read_text()) == \
        results["rounds"][-1]["eval"]["per_client"]
    assert json.loads((artifacts / "results.json").read_text())["status"] == "completed"


def http_json(url: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return json.loads(reply.read())


def serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200 and b"<html" in reply.read(4096).lower()
    except OSError:
        return False


@contextlib.contextmanager
def viewer(command: list[str], port: int):
    """A viewer started as docs/tracking.md writes it, on loopback; its page served."""
    installed = Path(sys.executable).parent  # the console scripts of the tracking extra
    process = subprocess.Popen([str(installed / command[0]), *command[1:], "--host",
                                "127.0.0.1", "--port", str(port)], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            assert process.poll() is None, f"{command[0]} exited with {process.returncode}"
            return serving(f"http://127.0.0.1:{port}/")

        wait_for(up, timeout=180)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_groups(process, term_wait=10)


@pytest.mark.integration
def test_the_viewers_open_a_tracked_runs_store_over_http(compared):
    run_dir = compared[0] / "runs" / "fedavg" / "report-defaults-seed2"
    results = json.loads((run_dir / "results.json").read_text())
    accuracy = [r["eval"]["accuracy_weighted"] for r in results["rounds"]]
    store = f"sqlite:///{run_dir / 'mlflow.db'}"
    with viewer(["mlflow", "ui", "--workers", "1", "--backend-store-uri", store],
                free_port()) as url:
        api = f"{url}/api/2.0/mlflow"
        experiment = http_json(f"{api}/experiments/get-by-name?experiment_name=pflower")
        (run,) = http_json(f"{api}/runs/search",
                           {"experiment_ids": [experiment["experiment"]["experiment_id"]]}
                           )["runs"]
        assert run["info"]["run_name"] == "fedavg-seed2"
        assert run["info"]["status"] == "FINISHED"
        query = urllib.parse.urlencode({"run_id": run["info"]["run_id"],
                                        "metric_key": "accuracy/weighted"})
        history = http_json(f"{api}/metrics/get-history?{query}")["metrics"]
        assert [(m["step"], m["value"]) for m in history] == list(enumerate(accuracy, 1))
    # all the comparison's runs side by side, as docs/tracking.md says
    with viewer(["tensorboard", "--logdir", str(compared[0] / "runs")], free_port()) as url:
        run_name = "fedavg/report-defaults-seed2/tensorboard"
        wait_for(lambda: run_name in http_json(f"{url}/data/runs"), timeout=60)
        query = urllib.parse.urlencode({"run": run_name, "tag": "accuracy/weighted"})
        scalars = http_json(f"{url}/data/plugin/scalars/scalars?{query}")
        assert [(step, pytest.approx(value, rel=1e-6)) for _, step, value in scalars] == \
            list(enumerate(accuracy, 1))


def test_a_stored_run_is_reused_only_under_the_same_numbers_config(tmp_path):
    """compare keeps each run's record beside its folder and reuses it by the one rule of
    ``comparison.runs`` (tests/test_runs.py): here, through ``Comparison.summary``."""
    from launch.compare import Comparison
    from launch.federation import LocalFederation

    comparison = Comparison(None, ROOT, {"num-server-rounds": 2}, tmp_path,
                            LocalFederation.federation_config(2, 1, 0.0), 60, 0.2)
    row = parse_row("fedavg", app_defaults(ROOT), [])
    out = tmp_path / "runs" / "fedavg" / "report-defaults-seed1"
    config = {**comparison.run_config(row, "report", {}, 1), "output-dir": str(out)}
    record = {"resolved_config": comparison.store.resolved(config), "num_clients": 2,
              "accuracy_per_round": [0.5]}
    stored = out.with_name("report-defaults-seed1.json")
    stored.parent.mkdir(parents=True)
    stored.write_text(json.dumps(record))
    assert comparison.summary(row, "report", {}, 1)["accuracy_per_round"] == [0.5]
    # moved, or tracked this time: the same numbers
    moved = {**record["resolved_config"], "output-dir": "/elsewhere", "tracking": "mlflow"}
    stored.write_text(json.dumps({**record, "resolved_config": moved}))
    assert comparison.summary(row, "report", {}, 1) is not None
    # a default that changed since (the app's pyproject), or another number of clients: not
    # reused
    stored.write_text(json.dumps({**record, "resolved_config": {**moved, "lr": 0.01}}))
    assert comparison.summary(row, "report", {}, 1) is None
    stored.write_text(json.dumps({**record, "num_clients": 3}))
    assert comparison.summary(row, "report", {}, 1) is None


def test_the_round_axis_has_ticks_on_whole_rounds_only():
    """A run of 2 rounds has no round 1.5 (matplotlib's default ticks it)."""
    import matplotlib.pyplot as plt

    from comparison.plots import draw_curves, figure

    fig, (ax,) = figure(7, 4.5)
    draw_curves(ax, {"fedavg": ([1, 2], [[0.2, 0.3], [0.25, 0.35]])})
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    plt.close(fig)


def test_every_row_of_a_plot_has_its_own_colour_and_neighbours_differ_in_line_style():
    """The matrix's scenarios have up to 12 rows: no two may look alike."""
    from matplotlib.colors import rgb_to_hsv, to_rgb

    from comparison.plots import draw_accuracy_vs_uplink, draw_curves, figure

    rows = {f"method{i}": ([1, 2, 3], [[0.1 * i, 0.2, 0.3], [0.1, 0.2, 0.3]])
            for i in range(12)}
    _, (curves, points) = figure(8, 4, columns=2)
    draw_curves(curves, rows)
    draw_accuracy_vs_uplink(points, {label: (float(i), 0.5, 0.01)
                                     for i, label in enumerate(rows)})
    lines = curves.get_lines()
    assert [line.get_label() for line in lines] == list(rows)
    colours = [to_rgb(line.get_color()) for line in lines]
    assert len(set(colours)) == 12
    # nor two of one hue family (FedAvg's dark blue and pFedC's pale blue looked alike):
    # hues at least 0.03 apart, unless one is grey or black or their brightness differs
    hsv = [rgb_to_hsv(c) for c in colours]
    for (h1, s1, v1), (h2, s2, v2) in itertools.combinations(hsv, 2):
        hue_gap = min(abs(h1 - h2), 1 - abs(h1 - h2))
        assert hue_gap >= 0.03 or min(s1, s2) < 0.1 or abs(v1 - v2) > 0.25
    styles = [line.get_linestyle() for line in lines]
    assert all(a != b for a, b in itertools.pairwise(styles))
    markers = [c.lines[0].get_marker() for c in points.containers]
    assert len(set(zip(colours, markers, strict=True))) == 12
    # every point is labelled where it stands; a log axis only for uplinks over a factor of
    # 10 (Local sends 0 MB, which a log axis cannot show)
    assert [t.get_text() for t in points.texts] == list(rows)
    assert points.get_xscale() == "linear"
    _, (wide, narrow) = figure(8, 4, columns=2)
    draw_accuracy_vs_uplink(wide, {"a": (0.4, 0.5, 0.0), "b": (16.0, 0.6, 0.0)})
    draw_accuracy_vs_uplink(narrow, {"a": (16.0, 0.5, 0.0), "b": (16.4, 0.6, 0.0)})
    assert (wide.get_xscale(), narrow.get_xscale()) == ("log", "linear")

