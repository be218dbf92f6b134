"""The fork server (``launch/forkserver.py``): a command started through its shim behaves as
the process it replaces (arguments, streams, environment, folder, exit status, signals), a
child whose shim is killed stops, and with no server the shim runs the real command. The
integration tests run every warm simulation's ``flwr-simulation`` and the deployments'
``flwr-clientapp`` through it (``tests/conftest.py``), and a warm run equals a cold one
(``tests/test_simulation.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from launch.forkserver import COMMANDS, SOCKET_ENV, ForkServer

pytestmark = pytest.mark.integration  # it starts Flower's own flwr-clientapp
PROBE = "pflower-probe"


@pytest.fixture(scope="module")
def forks():
    with ForkServer({**COMMANDS, PROBE: "tests.forked_probe:main"}) as server:
        yield server


def _env(forks: ForkServer, **extra: str) -> dict[str, str]:
    warm = forks.env()
    return {**os.environ, **warm, **extra,
            "PATH": f"{warm['PATH']}{os.pathsep}{os.environ['PATH']}"}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def test_the_commands_are_flowers_own_entry_points():
    for command, target in COMMANDS.items():
        assert [e.value for e in entry_points(group="console_scripts", name=command)] == [
            target]


def test_a_forked_command_gets_its_arguments_folder_environment_and_streams(forks, tmp_path):
    extra = tmp_path / "probe-extra"
    extra.mkdir()
    done = subprocess.run(
        [PROBE, "report", "x y"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env=_env(forks, PROBE_MARKER="m1", OMP_NUM_THREADS="1", PYTHONPATH=str(extra)))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["argv"][1:] == ["report", "x y"] and seen["argv"][0].endswith(PROBE)
    assert seen["cwd"] == str(tmp_path)
    assert seen["marker"] == "m1"
    assert seen["threads"] == 1            # as OMP_NUM_THREADS=1 gives a new process
    assert seen["path_has"] == [str(extra)]
    # forked: a child of the fork server, not of the shim that asked for it
    assert seen["ppid"] == forks.process.pid
    again = subprocess.run([PROBE, "report"], capture_output=True, text=True, timeout=60,
                           env=_env(forks))
    assert json.loads(again.stdout)["marker"] is None  # nothing carried from the last one


def test_exit_status_and_stderr_come_back(forks):
    done = subprocess.run([PROBE, "exit", "3"], capture_output=True, text=True, timeout=60,
                          env=_env(forks))
    assert (done.returncode, done.stderr.strip()) == (3, "leaving")


def test_a_signal_to_the_shim_stops_the_child_and_the_shim_ends_by_it(forks, tmp_path):
    pid_file = tmp_path / "pid"
    shim = subprocess.Popen([PROBE, "wait", str(pid_file)], env=_env(forks))
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(30) == -signal.SIGTERM
    assert not _pid_alive(child)


def test_a_child_whose_shim_is_killed_stops(forks, tmp_path):
    pid_file = tmp_path / "pid"
    shim = subprocess.Popen([PROBE, "wait", str(pid_file)], env=_env(forks))
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    shim.kill()                            # as stop_process_groups ends a SuperNode's group
    shim.wait(10)
    deadline = time.monotonic() + 30
    while _pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _pid_alive(child)


def test_without_a_reachable_server_the_shim_runs_the_real_command(forks, tmp_path):
    env = {**_env(forks), SOCKET_ENV: str(tmp_path / "no-socket")}
    done = subprocess.run(["flwr-clientapp", "--help"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0 and "usage: flwr-clientapp" in done.stdout
