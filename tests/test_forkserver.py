"""The fork server (``launch/forkserver.py``): a command started through its shim behaves as
the process it replaces (arguments, streams, environment, folder, exit status, signals), a
child whose shim is killed stops, and with no server the shim runs the real command. The
integration tests run every warm simulation's ``flwr-simulation`` and the deployments'
``flwr-clientapp`` through it (``tests/conftest.py``), and a warm run equals a cold one
(``tests/test_simulation.py``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from launch.deployment import namespaces_available
from launch.forkserver import COMMANDS, SOCKET_ENV
from launch.warm_start import ForkServer
from tests.conftest import wait_for

pytestmark = pytest.mark.integration  # it starts Flower's own flwr-clientapp
PROBE = "pflower-probe"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def forks():
    with ForkServer({**COMMANDS, PROBE: "tests.forked_probe:main"},
                    import_path=[ROOT]) as server:
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


def _waiting_child(forks: ForkServer, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """A shim whose forked child waits to be stopped, and the child's pid."""
    pid_file = tmp_path / "pid"
    shim = subprocess.Popen([PROBE, "wait", str(pid_file)], env=_env(forks))
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not pid_file.exists():
        shim.kill()
        pytest.fail("the forked child did not start")
    return shim, int(pid_file.read_text())


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


@pytest.mark.skipif(not namespaces_available() or shutil.which("unshare") is None,
                    reason="no network namespaces here (root and iproute2 needed)")
def test_a_shim_in_another_network_namespace_gets_a_child_in_it(forks):
    """As a site of LocalDeployment(namespaces=True) asks: its ClientApp must reach the
    site's SuperNode on the site's own network."""
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", f"stat -L -c %i /proc/self/ns/net && {PROBE} report"],
        capture_output=True, text=True, timeout=60, env=_env(forks))
    assert done.returncode == 0, done.stderr
    shim_network, report = done.stdout.split("\n", 1)
    seen = json.loads(report)
    assert seen["ppid"] == forks.process.pid            # forked, not the real command
    assert seen["network"] == int(shim_network) != os.stat("/proc/self/ns/net").st_ino


def test_exit_status_and_stderr_come_back(forks):
    done = subprocess.run([PROBE, "exit", "3"], capture_output=True, text=True, timeout=60,
                          env=_env(forks))
    assert (done.returncode, done.stderr.strip()) == (3, "leaving")


def test_a_signal_to_the_shim_stops_the_child_and_the_shim_ends_by_it(forks, tmp_path):
    shim, child = _waiting_child(forks, tmp_path)
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(30) == -signal.SIGTERM
    assert not _pid_alive(child)


def test_a_child_whose_shim_is_killed_stops(forks, tmp_path):
    shim, child = _waiting_child(forks, tmp_path)
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


def test_a_child_killed_by_sigkill_ends_its_shim_the_same_way(forks, tmp_path):
    shim, child = _waiting_child(forks, tmp_path)
    assert Path(f"/proc/{child}/comm").read_text().strip() == PROBE[:15]  # ps, pgrep
    os.kill(child, signal.SIGKILL)
    assert shim.wait(30) == -signal.SIGKILL


def test_a_shim_gone_before_its_answer_does_not_stop_the_server(forks):
    for _ in range(3):  # a request, then the asker vanishes before reading the child's pid
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(forks.socket_path))
            request = {"command": PROBE, "argv": [PROBE, "exit", "0"], "cwd": "/",
                       "env": dict(os.environ)}
            socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(forks.socket_path))
            sock.send(b"not a request")
    done = subprocess.run([PROBE, "report"], capture_output=True, text=True, timeout=60,
                          env=_env(forks))
    assert done.returncode == 0 and json.loads(done.stdout)["ppid"] == forks.process.pid


def test_exec_mode_serves_flowers_commands_beside_the_program_it_becomes(tmp_path):
    """The SuperExec image's entrypoint (deploy/superexec.Dockerfile): the program (there
    flower-superexec) runs with the shims first on PATH, a server for Flower's commands
    listens at the socket it is given, and stops when the program is gone, its folder
    removed."""
    program = ("import json, os, sys; print(json.dumps({'path': os.environ['PATH'], "
               f"'socket': os.environ['{SOCKET_ENV}']}}), flush=True); sys.stdin.read()")
    started = subprocess.Popen(
        [sys.executable, "-P", str(ROOT / "launch" / "forkserver.py"), "--exec",
         sys.executable, "-c", program],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        seen = json.loads(started.stdout.readline())
        bin_dir = Path(seen["path"].split(os.pathsep)[0])
        assert sorted(p.name for p in bin_dir.iterdir()) == sorted(COMMANDS)
        socket_path = Path(seen["socket"])
        wait_for(socket_path.exists, 120, poll=0.1)      # the server's imports
        read_end, write_end = os.pipe()
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.connect(str(socket_path))   # as a shim asks: the server forks the command
            request = {"command": "flwr-clientapp", "argv": ["flwr-clientapp", "--help"],
                       "cwd": str(tmp_path), "env": dict(os.environ)}
            socket.send_fds(sock, [json.dumps(request).encode()], [0, write_end, 2])
            os.close(write_end)
            assert int(sock.recv(64)) > 0 and int(sock.recv(64)) == 0
        with os.fdopen(read_end) as output:
            assert "usage: flwr-clientapp" in output.read()
        started.stdin.close()                 # the program leaves: so does the server
        assert started.wait(30) == 0
        wait_for(lambda: not socket_path.parent.exists(), 30, poll=0.1)  # its folder too
    finally:
        started.kill()
        if "socket_path" in locals():
            shutil.rmtree(socket_path.parent, ignore_errors=True)
