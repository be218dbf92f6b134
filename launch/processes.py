"""Ports, process groups and output for the launchers: a free port for a server we start,
stopping a process with every process it started, and what the processes print less its
colour codes where it is not shown on a terminal."""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

_HANDED_OUT: set[int] = set()


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


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def descendants(pid: int) -> dict[int, int]:
    """``pid``'s descendants, each with its process group (Linux ``/proc``; empty
    elsewhere)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append((int(stat.parent.name), int(fields[2])))
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


def stop_process_groups(process: subprocess.Popen, term_wait: float) -> None:
    """Stop ``process`` and every process it started, each in its process group: SIGTERM,
    up to ``term_wait`` seconds for ``process`` to exit, then SIGKILL to any group left."""
    groups = ({process.pid} | descendant_groups(process.pid)) - {os.getpgrp()}
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
        while (groups := {g for g in groups if _group_alive(g)}) and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        if not groups:
            break


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
