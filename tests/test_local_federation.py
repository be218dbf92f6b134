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


# a parent in a session of its own whose child, in another session, ignores SIGTERM (as a
# finished run's flwr-simulation takes seconds to wind PyTorch down on it): prints the child's
# pid, then waits
_STUBBORN = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('ready', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("kill_others", [False, True])
def test_stopping_a_process_stops_what_it_started_in_other_sessions(kill_others):
    """``stop_process_groups``: the groups ``process`` started are stopped with it; with
    ``kill_others`` (a SuperLink whose runs have all ended) at once, without the second a
    group that ignores SIGTERM gets before SIGKILL."""
    from launch.processes import stop_process_groups

    parent = subprocess.Popen([sys.executable, "-c", _STUBBORN], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    began = time.monotonic()
    stop_process_groups(parent, 15, kill_others=kill_others)
    took = time.monotonic() - began
    time.sleep(0.2)
    assert not _alive({parent.pid, child})
    if kill_others:
        assert took < 0.9, took
    else:
        assert took >= 1.0, took  # SIGTERM, a second for the other groups, then SIGKILL


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_watched_command_gives_its_lines_and_processes_in_time_and_what_it_left_is_stopped():
    """``launch.processes.watch`` (bench/overhead.py's timeline): each output line and each
    process the command started, detached ones included, with the seconds from its start;
    what it left running is named and stopped."""
    from launch.processes import watch

    script = ("echo first; sleep 0.5; setsid sleep 30 < /dev/null > /dev/null 2>&1 & "
              "sleep 0.5; echo second")
    run = watch(["bash", "-c", script], dict(os.environ), ROOT)
    assert run.code == 0
    assert [line for _, line in run.lines] == ["first\n", "second\n"]
    (first, _), (second, _) = run.lines
    assert 0 <= first < 0.5 <= second - first < 5  # the last one read as, or after, it exits
    sleepers = [at for at, title in run.titles if title == "sleep 30"]
    assert len(sleepers) == 1 and first <= sleepers[0] <= second
    assert run.left == ["sleep 30"]
    time.sleep(0.2)
    assert not [p for p in _alive({int(p.name) for p in Path("/proc").glob("[0-9]*")})
                if _cmdline(p).strip() == "sleep 30" and _is_ours(p, run.started)]


def _is_ours(pid: int, since: float) -> bool:
    """Started since ``since`` (seconds since boot): a sleeper of this test's, not another's."""
    from launch.processes import process_table

    info = process_table().get(pid)
    return info is not None and info.started >= since - 0.1


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_partition_that_cannot_be_drawn_stops_the_superlink_started_beside_its_draw(
        tmp_path):
    """The demo's launcher starts its SuperLink while it checks the method and draws the
    partition (seconds of PyTorch and datasets): a draw that fails (digits over 300 clients)
    stops the SuperLink, and all it started, before its one line and exit 2."""
    from launch.processes import watch

    run = watch(["bash", str(ROOT / "scripts" / "demo.sh"), f"output-dir={tmp_path / 'out'}"],
                {**os.environ, "SUPERNODES": "300"}, ROOT)
    assert run.code == 2
    [(_, line)] = run.lines
    assert line.startswith("pflower: dirichlet: no draw in 10 gave each of 300 clients"), line
    assert any("flower-superlink" in title for _, title in run.titles)
    assert run.left == []
    assert not (tmp_path / "out").exists()
