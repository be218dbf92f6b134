"""Ports, processes and output for the launchers: a free port for a server we start, the
processes running (``/proc``), stopping a process with every process it started, and what the
processes print less its colour codes where it is not shown on a terminal."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

_HANDED_OUT: set[int] = set()
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port to give a server we start, free now and below the kernel's ephemeral range:
    a port taken from that range (``bind(0)``) is released before our server binds it, and
    Flower's own processes (a SuperLink's runtime API, a SuperExec) bind ephemeral ports in
    the meantime; one of them once took a SuperNode's port, which then could not start."""
    rng = random.SystemRandom()
    low = _ephemeral_low()
    for _ in range(200):
        # above 20,000: Ray gives its workers ports 10,002-19,999
        port = rng.randrange(20_000, low) if low > 21_000 else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port found below the ephemeral range")


def wait_until_serving(process: subprocess.Popen, url: str, timeout: float) -> str | None:
    """Until ``url`` answers (asked every 0.1 s): None; else why not: "exited" (``process``
    did), or that it did not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return "exited"
        try:
            with urllib.request.urlopen(url, timeout=1):
                return None
        except OSError:
            time.sleep(0.1)
    return f"did not become healthy within {timeout:.0f} s"


def exit_on_sigterm(signum: int, frame: object) -> None:
    """A SIGTERM handler that raises ``SystemExit``: a process killed (kill, a timeout) still
    leaves its ``with`` blocks, which stop what they started."""
    raise SystemExit(128 + signum)


class ProcessInfo(NamedTuple):
    parent: int
    group: int
    running: bool  # False for one that exited and waits to be reaped (a zombie)
    started: float  # seconds since boot (CLOCK_BOOTTIME)
    cpu: float  # CPU seconds it used


def process_table() -> dict[int, ProcessInfo]:
    """Every process (Linux ``/proc``; empty elsewhere)."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
            table[int(stat.parent.name)] = ProcessInfo(
                int(fields[1]), int(fields[2]), fields[0] != "Z", int(fields[19]) / _TICKS,
                (int(fields[11]) + int(fields[12])) / _TICKS)
        except (OSError, IndexError, ValueError):
            continue
    return table


def alive_groups(groups: set[int]) -> set[int]:
    """Those of ``groups`` in which a process still runs (a zombie, one that exited but is not
    yet reaped by its parent, does not): one read of ``/proc`` for all of them."""
    signalled, not_ours = set(), set()  # not ours: kill may not ask, so counted alive
    for group in groups:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            not_ours.add(group)
            continue
        signalled.add(group)
    if not signalled or not Path("/proc/self/stat").exists():
        return signalled | not_ours  # kill's answer stands
    running = {info.group for info in process_table().values() if info.running}
    return (signalled & running) | not_ours


def descendants(pid: int) -> dict[int, int]:
    """``pid``'s descendants, each with its process group (Linux ``/proc``; empty
    elsewhere)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for child, info in process_table().items():
        children.setdefault(info.parent, []).append((child, info.group))
    found, todo = {}, [pid]
    while todo:
        for child, group in children.get(todo.pop(), []):
            found[child] = group
            todo.append(child)
    return found


def descendant_groups(pid: int) -> set[int]:
    """The process groups of ``pid``'s descendants.

    The SuperExec that the SuperLink starts opens a session of its own, and the
    ``flwr-simulation`` and Ray processes it starts live in it: stopping the SuperLink's group
    alone leaves them running a run that was interrupted."""
    return set(descendants(pid).values())


def stop_process_groups(process: subprocess.Popen, term_wait: float,
                        kill_others: bool = False) -> None:
    """Stop ``process`` and every process it started, each in its process group: SIGTERM,
    up to ``term_wait`` seconds for ``process`` to exit, then SIGKILL to any group left.
    ``kill_others``: the groups other than ``process``'s get SIGKILL at once (they hold
    nothing left to save: a SuperLink's SuperExec session once its runs have ended)."""
    groups = ({process.pid} | descendant_groups(process.pid)) - {os.getpgrp()}
    if kill_others:
        for group in groups - {process.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, 5)):
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        # the other groups' processes exit on SIGTERM within a second
        deadline = time.monotonic() + 1
        while (groups := alive_groups(groups)) and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        if not groups:
            break


def stop_groups_of(pids: set[int], wait: float = 10) -> None:
    """Stop those of ``pids`` still running, each with its process group: SIGTERM, up to
    ``wait`` seconds, then SIGKILL (processes started detached, none of ours a parent)."""
    table = process_table()
    groups = {table[pid].group for pid in pids if pid in table} - {os.getpgrp()}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)
        deadline = time.monotonic() + wait
        while (groups := alive_groups(groups)) and time.monotonic() < deadline:
            time.sleep(0.1)


class Watched(NamedTuple):
    """A command run to its exit by ``watch``: when, what it printed and started, at what
    cost. Times are seconds from its start."""

    code: int
    started: float  # seconds since boot (CLOCK_BOOTTIME), as ``ProcessInfo.started``
    wall: float
    lines: list[tuple[float, str]]  # its output's lines (stdout and stderr), as they came
    titles: list[tuple[float, str]]  # each process it started, at its start, and each new
    # title a process gave itself (a Ray worker's ``ray::ClientAppActor``), as first seen
    left: list[str]  # those still running once it had exited (then stopped)
    cpu: float  # CPU seconds of the command and every process it started
    others: float  # cores busy with other work meanwhile (average; the watching not counted)


def watch(command: list[str], env: dict[str, str], cwd: Path, poll: float = 0.05) -> Watched:
    """Run ``command`` to its exit, watching its output and every process it starts (those
    started detached too: a process stays watched when its parent is gone) every ``poll``
    seconds; whatever of them still runs after it exits is stopped (``stop_groups_of``).
    A process is known by its pid and start time (pids are reused). Linux ``/proc`` only."""
    started, busy, own = _boot_seconds(), _busy_seconds(), time.process_time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=cwd, env=env)
    born: dict[int, float] = {}  # pid: start time, of each process it started (itself too)
    cpu, titles, seen, lines = {}, {}, [], []
    done = threading.Event()

    def ours(table: dict[int, ProcessInfo]) -> set[int]:
        return {pid for pid, at in born.items() if pid in table and table[pid].started == at}

    def poll_tree() -> None:
        while not done.is_set():
            table = process_table()
            if not born and process.pid in table:
                born[process.pid] = table[process.pid].started
            mine = ours(table)
            while new := {p for p, info in table.items() if p not in born and info.parent in mine}:
                born.update((p, table[p].started) for p in new)
                mine |= new
            for pid in mine:
                cpu[pid] = table[pid].cpu
                with contextlib.suppress(OSError):
                    title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    if titles.get(pid) != title:
                        at = table[pid].started if pid not in titles else _boot_seconds()
                        seen.append((at - started, title.decode(errors="replace").strip()))
                        titles[pid] = title
            done.wait(poll)

    def read() -> None:
        lines.extend((_boot_seconds() - started, line) for line in process.stdout)

    threads = [threading.Thread(target=target, daemon=True) for target in (poll_tree, read)]
    for thread in threads:
        thread.start()
    code, wall = process.wait(), _boot_seconds() - started
    busy, own = _busy_seconds() - busy, time.process_time() - own
    threads[1].join(5)  # its last lines (a process it left may hold the pipe: stopped below)
    done.set()
    threads[0].join()
    table = process_table()
    alive = {pid for pid in ours(table) if table[pid].running}
    left = [titles[pid].decode(errors="replace").strip() for pid in alive if pid in titles]
    stop_groups_of(alive)
    threads[1].join()
    used = sum(cpu.values())
    return Watched(code, started, wall, list(lines), sorted(seen), left, used,
                   max(0.0, (busy - used - own) / wall))


def _boot_seconds() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)  # the clock of /proc's start times


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy, all cores (``/proc/stat``)."""
    user, nice, system, _idle, _iowait, *rest = map(
        int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + sum(rest)) / _TICKS


# Flower colours each line's level (flwr.common.logger's ConsoleHandler: always, with no
# setting to turn it off) in every process of a run, whatever its output: a run's stream
# carries the codes. Any ANSI control sequence (CSI), colours included
ANSI_CODE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def uncoloured(text: str) -> str:
    """``text`` less its colour codes (a log file, an output that is not a terminal)."""
    return ANSI_CODE.sub("", text)


class Uncoloured:
    """A text stream that passes on what is written to it less colour codes: the echo of a
    run whose output goes to a file or a pipe."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(uncoloured(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def for_terminal_only(stream: Any) -> Any:
    """``stream`` itself where it is a terminal (the colours shown), else ``Uncoloured``."""
    isatty = getattr(stream, "isatty", None)
    return stream if isatty is not None and isatty() else Uncoloured(stream)
