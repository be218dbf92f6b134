"""Experiment tracking (server_app/tracking.py). What a real run writes is read back in
tests/test_compare.py, whose comparison runs with both trackers on; here the viewers start as
docs/tracking.md writes them, and print only what it explains."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from common.config import ConfigError
from launch.processes import free_port, stop_process_groups
from server_app import tracking
from server_app.tracking import Tracking
from strategies.registry import load_settings
from tests.conftest import ROOT, app_config, wait_for

ROUND = {"round": 3, "seconds": 1.5, "bytes_up": 100, "bytes_down": 200,
         "train": {"loss": 0.7, "num_clients": 2},
         "eval": {"accuracy_weighted": 0.8, "accuracy_mean": 0.75, "accuracy_std": 0.05,
                  "accuracy_min": 0.7, "num_clients": 2, "per_client": {"0": 0.7, "1": 0.8}}}


def test_tracking_names_are_checked_with_one_line():
    assert load_settings(app_config(tracking="mlflow, tensorboard")).trackers() == [
        "mlflow", "tensorboard"]
    assert load_settings(app_config()).trackers() == []
    with pytest.raises(ConfigError, match=r"^tracking: unknown value 'wandb'; allowed: "
                                          r"tensorboard, mlflow$"):
        load_settings(app_config(tracking="tensorboard,wandb"))


def test_a_tracker_whose_package_is_missing_stops_with_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(tracking.REQUIREMENTS, "mlflow", ("no_such_module_xyz", "mlflow"))
    with pytest.raises(ConfigError) as raised:
        Tracking(["tensorboard", "mlflow"], tmp_path, {})
    # the interpreter that runs the ServerApp, named: a plain pip may be another Python's
    assert str(raised.value) == ("tracking: mlflow not installed where the ServerApp runs; "
                                 f"install the extra: {sys.executable} -m pip install -e "
                                 "'.[tracking]'")
    assert not (tmp_path / "tensorboard").exists()  # nothing started


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_others_go_on(tmp_path, caplog):
    class FullDisk:
        def log_round(self, entry):
            raise OSError(28, "No space left on device")

        def close(self, payload):
            raise AssertionError("a dropped tracker is not called again")

    run = Tracking(["tensorboard"], tmp_path, {"method": "fedavg"})
    run.trackers = {"broken": FullDisk(), **run.trackers}
    run.log_round(ROUND)
    run.log_round({**ROUND, "round": 4})
    run.close({"status": "completed"})
    assert "[tracking] broken stopped: OSError" in caplog.text
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("accuracy/weighted")] == [3, 4]
    assert events.Scalars("loss/train")[0].value == pytest.approx(0.7)
    assert events.Scalars("bytes/down")[0].value == 200


def test_a_tracker_that_cannot_start_stops_the_run_with_one_line(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # the output-dir's place is taken by a file
    with pytest.raises(ConfigError, match=r"^tracking: mlflow could not start in "):
        Tracking(["mlflow"], Path(blocked), {})


DOCS = ROOT / "docs" / "tracking.md"


def docs_commands() -> list[str]:
    """The commands of docs/tracking.md's first shell block, continued lines joined,
    comments left out."""
    text = DOCS.read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.join(shlex.split(line, comments=True)) for line in block.splitlines()
            if line.strip()]


def test_the_tracking_docs_run_venvs_programs_not_the_systems():
    """Without ``.venv`` activated, a bare ``pip`` installs into another Python (the
    system's) and a bare viewer is another one, or none."""
    commands = docs_commands()
    programs = [next(word for word in shlex.split(command) if "=" not in word)
                for command in commands]
    assert programs == [".venv/bin/pip", "bash", ".venv/bin/tensorboard", ".venv/bin/mlflow"]
    assert commands[0] == ".venv/bin/pip install -e '.[tracking]'"


def explained_lines() -> list[re.Pattern]:
    """The lines docs/tracking.md says the viewers print: each bullet's quoted start, its
    ``<placeholders>`` standing for any text."""
    section = DOCS.read_text().split("### What the viewers print at start", 1)[1]
    section = section.split("\n#", 1)[0]
    quotes = re.findall(r"^- `([^`]+)`", section, re.M)
    assert len(quotes) >= 4, quotes
    return [re.compile(".+".join(map(re.escape, re.split(r"<[^>]+>", quote))))
            for quote in quotes]


def unexplained(output: str, explained: list[re.Pattern]) -> list[str]:
    """The lines of ``output`` that no explained line accounts for: a blank line, or one
    indented under an explained one, belongs to it (a note, a warning's source line)."""
    left, previous = [], True
    for line in output.splitlines():
        if not line.strip() or line[0].isspace():
            if not previous:
                left.append(line)
            continue
        previous = any(pattern.search(line) for pattern in explained)
        if not previous:
            left.append(line)
    return left


def test_the_check_of_what_the_viewers_print_sees_a_new_line():
    explained = explained_lines()
    printed = ("TensorFlow installation not found - running with reduced feature set.\n\n"
               "NOTE: Using experimental fast data loading logic. To disable, pass\n"
               '    "--load_fast=false" and report issues on GitHub. More details:\n'
               "TensorBoard 2.21.0 at http://localhost:6006/ (Press CTRL+C to quit)\n"
               "2026/01/01 12:00:00 INFO:     Started server process [1]\n")
    assert unexplained(printed, explained) == []
    new = "2026/01/01 12:00:00 INFO mlflow.server.jobs.executor_registry: Available backends\n"
    assert unexplained(printed + new + "  more of it\n", explained) == [
        new.strip(), "  more of it"]


def serving(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


@pytest.mark.integration
@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "mlflow").exists(),
                    reason="the docs' commands run this checkout's .venv")
@pytest.mark.parametrize("viewer", ["tensorboard", "mlflow"])
def test_each_viewer_starts_as_the_docs_write_it_and_prints_only_what_they_explain(
        tmp_path, viewer):
    """The docs' command, run from the checkout with no environment activated (``PATH``
    without ``.venv``), on a store of one tracked round: it serves its page, and every line
    it printed until then is one docs/tracking.md explains."""
    out = tmp_path / "tracked"
    trackers = tracking.Tracking(["tensorboard", "mlflow"], out, {"method": "fedavg",
                                                                  "seed": 1})
    trackers.log_round(ROUND)
    trackers.close({"status": "completed"})
    (command,) = [c for c in docs_commands() if f".venv/bin/{viewer}" in c]
    port = free_port()
    command = command.replace("outputs/tracked", str(out)) + f" --port {port}"
    log = tmp_path / f"{viewer}.log"
    venv = {ROOT / ".venv" / "bin", Path(sys.executable).parent}
    path = os.pathsep.join(folder for folder in os.environ.get("PATH", "").split(os.pathsep)
                           if folder and Path(folder) not in venv)
    with log.open("wb") as sink:
        process = subprocess.Popen(["bash", "-c", command], cwd=ROOT, stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PATH": path})
    try:
        def up() -> bool:
            assert process.poll() is None, log.read_text()
            return serving(f"http://localhost:{port}/")

        wait_for(up, timeout=180)
        time.sleep(1)  # the lines after the one with the address
        printed = log.read_text()
    finally:
        stop_process_groups(process, term_wait=10)
    assert printed.strip(), "the viewer printed nothing: is the check looking?"
    assert unexplained(printed, explained_lines()) == [], printed
