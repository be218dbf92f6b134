"""``LocalFederation`` interrupted mid-run (a benchmark or test killed with SIGTERM) stops at
once and leaves no process behind, including the SuperExec's session (flwr-simulation, Ray);
the demo's echo keeps Flower's colours for a terminal only."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launch.processes import (
    _ephemeral_low,
    descendant_groups,
    for_terminal_only,
    free_port,
    uncoloured,
)

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    from launch.federation import LocalFederation
    with LocalFederation() as federation:
        federation.run(sys.argv[1], {"num-server-rounds": 500, "plot": False,
                                     "output-dir": sys.argv[2]}, num_supernodes=3)
""")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` still running (zombies waiting to be reaped count as gone)."""
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.add(pid)
    return alive


def _group_members(groups: set[int]) -> set[int]:
    members = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) in groups:
                members.add(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return members


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_sigterm_mid_run_stops_everything_the_federation_started(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(ROOT), str(tmp_path / "out")],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        started: set[int] = set()
        while time.monotonic() < deadline:  # until the simulation's clients train
            groups = descendant_groups(process.pid) - {os.getpgrp()}
            started = _group_members(groups)
            if (tmp_path / "out").exists() and any(
                    "flwr-simulation" in _cmdline(p) for p in started):
                break
            time.sleep(1)
        else:
            pytest.fail("the run did not start within 120 s")
        time.sleep(5)
        started = _group_members(descendant_groups(process.pid) - {os.getpgrp()})
        assert any("flwr-simulation" in _cmdline(p) for p in started)

        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        assert time.monotonic() - began < 45  # not the 500 rounds
        time.sleep(2)
        left = {p: _cmdline(p) for p in _alive(started)}
        assert not left, f"left running: {left}"
    finally:
        if process.poll() is None:
            process.kill()


def test_free_ports_are_distinct_and_outside_the_ephemeral_range():
    # a port from the ephemeral range can be taken by Flower's own processes (a SuperLink's
    # runtime API did take a SuperNode's) between our choosing it and our server binding it
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20_000 <= p < _ephemeral_low() for p in ports)


def test_the_echo_keeps_flowers_colours_for_a_terminal_only():
    """Flower colours its lines' levels whatever the output: the demo's echo drops the codes
    when its stdout is a file or a pipe (the real run: ``test_fail_fast``'s clean run)."""
    line = "\x1b[92mINFO \x1b[0m:      [round 1/3] training\n"
    assert uncoloured(line) == "INFO :      [round 1/3] training\n"
    piped = io.StringIO()
    print(line, end="", file=for_terminal_only(piped), flush=True)
    assert piped.getvalue() == "INFO :      [round 1/3] training\n"
    controller, terminal = os.openpty()
    try:
        with open(terminal, "w", closefd=False) as stream:
            assert for_terminal_only(stream) is stream
    finally:
        os.close(controller)
        os.close(terminal)


def _start_error(head) -> str | None:
    try:
        head.__enter__()
    except RuntimeError as error:  # the head stopped itself
        return str(error)
    return None


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_ray_heads_started_together_each_take_a_driver_and_stop_every_process_they_started():
    """Test workers each start a head at once: the heads must not share ports (``ray start``
    takes fixed ones by default, and three at once crashed each other's drivers), each must
    start no worker before a run asks for one, and each must leave nothing running when it
    stops."""
    from launch.ray_head import RayHead

    heads = [RayHead(num_cpus=1) for _ in range(3)]
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(heads)) as pool:
        errors = list(pool.map(_start_error, heads))
        for head, error in zip(heads, errors, strict=True):
            if error is None:
                stack.push(head)
        assert errors == [None] * len(heads)  # each head ran a trial driver
        started = _group_members(set().union(*(
            descendant_groups(head.process.pid) | {head.process.pid} for head in heads)))
        assert sum("gcs_server" in _cmdline(p) for p in started) == len(heads)
        # the trial driver started no worker (Ray logs each one it starts): one would import
        # PyTorch, and no run's job (each with its own runtime environment) could use it
        workers = [log.name for head in heads for log in
                   (head.temp_dir / "session_latest" / "logs").glob("python-core-worker-*")]
        assert not workers, workers
        temp_dirs = [head.temp_dir for head in heads]
    time.sleep(2)
    left = {p: _cmdline(p) for p in _alive(started)}
    assert not left, f"left running: {left}"
    assert not any(temp_dir.exists() for temp_dir in temp_dirs)
