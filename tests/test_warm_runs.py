"""Warm runs (``launch.federation.warm_federation``): the Ray head's workers import PyTorch and
Flower's actor as they start, and after each run it starts the next run's workers (``prime``),
which that run's actors then take; a ClientApp in a process that imported PyTorch early
still keeps to its thread budget. That a warm run gives a cold run's results:
``tests/test_simulation.py``; the fork server: ``tests/test_forkserver.py``."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from client_app.runtime import use_thread_budget
from launch.federation import FlowerRun
from launch.processes import descendants
from launch.ray_head import PRIME_MODULES
from tests.conftest import ROOT

SMALL = {"method": "fedavg", "num-server-rounds": 1, "local-epochs": 1, "plot": False}


def _run_watching(federation, config: dict, look: Callable[[], None]) -> FlowerRun:
    """Run ``config`` on 2 clients, calling ``look`` every 50 ms while it runs."""
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            look()
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return federation.run(ROOT, config, num_supernodes=2, timeout=600)
    finally:
        done.set()
        watcher.join()


def _run_and_watch(federation, config: dict, server_pid: int) -> set[str]:
    """Run ``config``, noting the names of the fork server's children while it runs (and
    "ok" if it completed)."""
    names: set[str] = set()

    def look() -> None:
        for pid in descendants(server_pid):
            with contextlib.suppress(OSError):
                names.add(Path(f"/proc/{pid}/comm").read_text().strip())

    run = _run_watching(federation, config, look)
    return names | ({"ok"} if run.ok else set())


def _primed_workers(head) -> set[int]:
    """The head's idle workers started for a run's job (its PYTHONPATH names the installed
    app) with PyTorch already imported."""
    primed = set()
    for pid in descendants(head.process.pid):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        if (title.startswith(b"ray::IDLE") and b"/apps/" in environ
                and "libtorch" in maps):
            primed.add(pid)
    return primed


@pytest.mark.integration
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_a_warm_run_leaves_the_next_runs_workers_and_the_next_run_takes_them(federation,
                                                                            tmp_path):
    head, forks = federation.ray_head, federation.forkserver
    seen = _run_and_watch(federation, {**SMALL, "output-dir": str(tmp_path / "a")},
                          forks.process.pid)
    assert "ok" in seen, seen
    assert "flwr-simulation" in seen  # the run's process was forked warm
    cpus = head.num_cpus or os.cpu_count() or 1  # what the head offers
    deadline, primed, last = time.monotonic() + 60, set(), None
    while time.monotonic() < deadline and (len(primed) < cpus
                                           or primed != last):  # settled: the same twice
        time.sleep(0.5)
        last, primed = primed, _primed_workers(head)
    assert len(primed) >= cpus, primed  # one per CPU, PyTorch imported
    titles: dict[int, set[bytes]] = {pid: set() for pid in primed}

    def look() -> None:  # what each primed worker runs while the next run is under way
        for pid, seen_titles in titles.items():
            with contextlib.suppress(OSError):
                seen_titles.add(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0])

    second = _run_watching(federation, {**SMALL, "output-dir": str(tmp_path / "b")}, look)
    assert second.ok, second.output[-3000:]
    # The run's actors were created in primed workers: such a worker's title turns from
    # ray::IDLE to the actor's. Other idle workers of the session's earlier runs may serve some
    # of its actors, so not necessarily all of these. (Whether a taken worker has already
    # exited when the run returns depends on the machine's load: it is not asked.)
    taken = {pid for pid, seen_titles in titles.items()
             if any(b"ClientAppActor" in title for title in seen_titles)}
    assert taken, titles


def test_priming_registers_no_logger_in_its_background_thread(federation):
    """``RayHead.prime`` runs in a thread as a run ends, while pytest walks logging's registry
    unlocked as the test's teardown starts: a logger registered then failed a teardown
    ("dictionary changed size during iteration"). The modules it needs were imported as the
    head started."""
    registered = set(logging.root.manager.loggerDict)
    for name in PRIME_MODULES:
        importlib.import_module(name)
    assert set(logging.root.manager.loggerDict) == registered
    assert federation.ray_head is not None


def test_a_client_keeps_to_its_thread_budget_in_a_process_that_imported_pytorch_first(
        monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)   # as a worker that imported PyTorch with no budget set
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # then given one CPU (Ray sets this)
        use_thread_budget()
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "")
        use_thread_budget()                          # no budget: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
