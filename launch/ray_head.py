"""A one-node Ray cluster that outlives runs, so that runs one after another skip Ray's start.

Without it every simulation's ``flwr-simulation`` process starts a private Ray instance and
shuts it down at the end. Started once (``ray start --head --block`` on a free port, in a
short private temp folder) and handed to ``LocalFederation(ray_address=head.address)``, the
runs join it instead (Flower's existing-cluster path, docs/scaling.md); their actors are
still their own (a run's Ray job ends with it).

    with warm_federation() as federation:  # RayHead() + LocalFederation(ray_address=...)
        for config in configs:
            federation.run(".", config)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from launch.federation import LocalFederation, free_port, stop_process_groups
from launch.forkserver import ForkServer

STARTED = "Ray runtime started."
WARM_UP = ("import sys, ray; ray.init(address=sys.argv[1], include_dashboard=False); "
           "ray.get(ray.remote(lambda: 0).remote()); ray.shutdown()")


class RayHead:
    """``ray start --head --block`` on a free port (context manager); stopped, with every
    process it started, on exit."""

    def __init__(self, num_cpus: int | None = None, num_gpus: int | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        # Ray's unix sockets live under the temp folder: their paths must stay short
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.log = self.temp_dir / "ray-head.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> RayHead:
        resources = [f"--num-cpus={self.num_cpus}"] if self.num_cpus is not None else []
        resources += [f"--num-gpus={self.num_gpus}"] if self.num_gpus is not None else []
        with self.log.open("wb") as log:
            # `ray start` binds workers (and drivers) to ports from 10002 up and its client
            # server to 10001: two heads at once (test workers) took the same ports and
            # crashed each other's drivers. Port 0 lets the system pick.
            self.process = subprocess.Popen(
                [str(Path(sys.executable).parent / "ray"), "start", "--head",
                 f"--port={self.port}", "--min-worker-port=0", "--max-worker-port=0",
                 f"--ray-client-server-port={free_port()}",
                 "--include-dashboard=false", "--disable-usage-stats",
                 f"--temp-dir={self.temp_dir}", *resources, "--block"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        deadline = time.monotonic() + 120
        while STARTED not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"ray start --head failed: {' '.join(tail) or 'no output'}")
            time.sleep(0.2)
        # A trial driver joins first. Without it, three heads started at once on 2 cores, the
        # first run on two of them failed: its flwr-simulation process sent its SuperLink no
        # heartbeat for a minute while joining. With it, 9 runs of 9 completed.
        try:
            subprocess.run([sys.executable, "-c", WARM_UP, self.address], check=True,
                           timeout=300, capture_output=True, text=True,
                           env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the Ray head at {self.address} took no driver: "
                               f"{driver_failure(error)}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            # --block: on SIGTERM `ray start` stops its node's processes
            stop_process_groups(self.process, 30)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def driver_failure(error: subprocess.CalledProcessError | subprocess.TimeoutExpired) -> str:
    """The line of a failed driver's output that says why (Ray prints a C++ stack after it)."""
    if isinstance(error, subprocess.TimeoutExpired):
        return f"no answer in {error.timeout:.0f} s"
    lines = [line for line in str(error.stderr or "").splitlines() if line.strip()]
    reasons = [line[line.find("Check failed"):] for line in lines if "Check failed" in line]
    return (reasons or lines or [f"exit status {error.returncode}"])[-1][:300]


@contextlib.contextmanager
def warm_federation(pythonpath: Sequence[str | Path] = (),
                    forkserver: ForkServer | None = None) -> Iterator[LocalFederation]:
    """A private SuperLink whose runs join one Ray head kept up between them, their
    ``flwr-simulation`` processes forked from a fork server (``forkserver``, or one of its
    own), so that one run after another skips Ray's start and Flower's imports (warm runs);
    what it started is stopped on exit. ``pythonpath``: as for ``LocalFederation``."""
    with contextlib.ExitStack() as started:
        forks = forkserver or started.enter_context(ForkServer())
        head = started.enter_context(RayHead())
        yield started.enter_context(LocalFederation(
            ray_address=head.address, pythonpath=pythonpath, forkserver=forks))
