"""How a fork server ends (``launch/forkserver.py``): once its launcher is gone (a
``pflower-supernode``'s SuperNode killed or crashed) it stops what it forked (SIGTERM, then
SIGKILL after a grace), removes its folder and exits; terminated itself, it removes its
folder and leaves its children to their shims. Its folder lies in the temporary folder
(``TMPDIR``) where a socket's path allows. A server that fails to start says why, and leaves
no folder. A site's fork server forks Flower's own SuperExec and ClientApp. The README's
recipe, stopped, leaves nothing behind within 5 s (``tests/test_deployment_loopback.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from launch.forkserver import FOLDER_PREFIX, private_folder
from launch.site import SITE_COMMANDS
from launch.warm_start import ForkServer
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[1]
PROBE, STUBBORN = "pflower-probe", "pflower-stubborn"


def _server() -> ForkServer:
    return ForkServer({PROBE: "tests.forked_probe:main", STUBBORN: "tests.stubborn_probe:main"},
                      import_path=[ROOT])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"


def _start(forks: ForkServer, argv: list[str], pid_file: Path) -> tuple[subprocess.Popen, int]:
    """A shim whose forked child waits (``argv``, then ``pid_file``), and the child's pid."""
    warm = forks.env()
    shim = subprocess.Popen([*argv, str(pid_file)], env={
        **os.environ, **warm, "PATH": f"{warm['PATH']}{os.pathsep}{os.environ['PATH']}"})
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not pid_file.exists():
        shim.kill()
        pytest.fail(f"the forked child of {argv} did not start")
    return shim, int(pid_file.read_text())


def test_a_sites_fork_server_serves_flowers_own_superexec_and_clientapp():
    for command, target in SITE_COMMANDS.items():
        assert [e.value for e in entry_points(group="console_scripts", name=command)] == [
            target]


def test_a_fork_servers_folder_is_in_tmpdir_unless_its_socket_path_would_be_too_long(
        monkeypatch):
    short = Path(tempfile.mkdtemp(prefix="t-", dir="/tmp"))
    too_long = short / ("x" * 80)
    too_long.mkdir()
    try:
        for tmpdir, parent in ((short, short), (too_long, Path("/tmp"))):
            monkeypatch.setenv("TMPDIR", str(tmpdir))
            monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads it again
            folder = private_folder()
            folder.rmdir()
            assert folder.parent == parent and folder.name.startswith(FOLDER_PREFIX)
    finally:
        too_long.rmdir()
        short.rmdir()


def test_a_server_that_fails_to_start_says_why_in_its_last_log_line_and_leaves_no_folder(
        tmp_path):
    broken = tmp_path / "broken"  # a PyTorch that cannot be imported: the server exits at once
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    server = ForkServer({PROBE: "tests.forked_probe:main"}, import_path=[broken, ROOT])
    with pytest.raises(RuntimeError, match="did not start: ImportError: no torch here"):
        server.__enter__()
    assert server.process.returncode is not None and not server.folder.exists()


@pytest.mark.integration
def test_a_server_whose_launcher_is_gone_stops_its_children_removes_its_folder_and_exits(
        tmp_path):
    with _server() as forks:
        polite, polite_child = _start(forks, [PROBE, "wait"], tmp_path / "polite")
        stubborn, stubborn_child = _start(forks, [STUBBORN], tmp_path / "stubborn")
        forks.process.stdin.close()  # as when the SuperNode that holds it exits
        assert forks.process.wait(60) == 0
        # each child's end reached its shim: SIGTERM, and SIGKILL for one that ignores it
        assert polite.wait(10) == -signal.SIGTERM
        assert stubborn.wait(10) == -signal.SIGKILL
        assert not _pid_alive(polite_child) and not _pid_alive(stubborn_child)
        assert not forks.folder.exists()


@pytest.mark.integration
def test_a_terminated_server_removes_its_folder_and_leaves_its_children_to_their_shims(
        tmp_path):
    with _server() as forks:
        shim, child = _start(forks, [PROBE, "wait"], tmp_path / "pid")
        forks.process.send_signal(signal.SIGTERM)  # the server alone, not its group
        assert forks.process.wait(60) == -signal.SIGTERM
        assert not forks.folder.exists()
        assert _pid_alive(child)  # it serves its shim still ...
        shim.send_signal(signal.SIGTERM)  # ... and stops with it
        shim.wait(30)
        wait_for(lambda: not _pid_alive(child), 30, poll=0.1)
