"""bench/overhead.py: on ``--device cuda`` each simulated client of a timed run gets its share of
the GPU (without one Ray hides the GPU and the client refuses ``device=cuda``); a cold run's
timeline, read from its output, processes and the launcher's marks; the report of the demo's
cold start against Flower's floor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.overhead import timed_run
from launch.federation import FlowerRun


class _RecordingFederation:
    """A run that completes at once with two rounds of 1.5 s; the GPU share asked is kept."""

    def __init__(self) -> None:
        self.gpu_shares: list[float] = []

    def run(self, app: Path, run_config: dict, num_supernodes: int, gpus_per_client: float,
            timeout: float) -> FlowerRun:
        self.gpu_shares.append(gpus_per_client)
        out = Path(run_config["output-dir"])
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps({"rounds": [{"seconds": 1.5}] * 2}))
        return FlowerRun(0, "", "1", "finished:completed", "")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_timed_run_on_cuda_gives_each_client_its_share_of_the_gpu(device, tmp_path):
    federation = _RecordingFederation()
    _, rounds = timed_run(federation, {"method": "fedavg", "device": device}, 20,
                          tmp_path / "out")
    [share] = federation.gpu_shares
    assert rounds == 3.0
    assert share * (os.cpu_count() or 1) == (pytest.approx(1) if device == "cuda" else 0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_cold_runs_milestones_come_from_its_output_its_processes_and_the_launchers_marks(
        tmp_path):
    from bench.overhead import MILESTONES, watched_run

    script = tmp_path / "run.sh"  # a file: its text is not on the command line
    script.write_text(
        "echo \"$(awk '{print $1}' /proc/uptime) config checked\" >> \"$PFLOWER_TIMELINE\"\n"
        "sleep 0.1; (exec -a flower-superlink sleep 0.3)\n"
        "echo 'INFO : [start] app'; sleep 0.2; echo 'INFO : identify: 3 of 3 nodes answered'\n")
    run = watched_run(["bash", str(script)], dict(os.environ), lambda: 0.25)
    assert run.rounds == 0.25 and run.wall >= 0.5
    assert set(run.events) == {"config checked (launcher)", "SuperLink process started",
                               "ServerApp ready (its first line)",
                               "preflight answered (data, model)"}
    assert {name for name, *_ in MILESTONES} >= set(run.events)
    # /proc/uptime and a process's start time: in hundredths of a second
    assert (-0.02 <= run.events["config checked (launcher)"]
            < run.events["SuperLink process started"]
            < run.events["ServerApp ready (its first line)"]
            < run.events["preflight answered (data, model)"])


def test_the_cold_report_gives_the_ratio_the_timeline_and_how_busy_the_machine_was():
    from bench.overhead import ColdRun, cold_report

    def run(wall: float, others: float, preflight: float | None) -> ColdRun:
        events = {} if preflight is None else {"preflight answered (data, model)": preflight}
        return ColdRun(wall, 1.0, events, 30.0, others)

    demo = [run(23.0, 0.0, 17.0), run(25.0, 0.02, 19.0)]
    floor = [run(21.0, 0.04, None), run(21.0, 0.5, None)]
    report = cold_report(demo, floor)
    # fixed costs 22 and 24 against 20 and 20: pair ratios 1.1 and 1.2
    assert "**1.15x** Flower's floor app's (median of 2 interleaved pairs' ratios; ratio of " \
           "the medians 1.15x)" in report
    assert "| preflight answered (data, model) | 18.0 s | – |" in report
    assert "| fixed cost (wall - rounds) | 23.0 s | 20.0 s |" in report
    assert "The machine was **not quiet**: other work kept 0.03 of its" in report
    assert "(median; 0.00 to 0.50;" in report
    assert "Over the pairs with under 0.1 cores of it in either run (1 of 2): 1.10x." in report
