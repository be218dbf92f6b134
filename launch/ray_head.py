"""A one-node Ray cluster that outlives runs, so that runs one after another skip Ray's start.

Without it every simulation's ``flwr-simulation`` process starts a private Ray instance and
shuts it down at the end. Started once (``ray start --head --block`` on a free port, in a
short private temp folder) and handed to ``LocalFederation(ray_head=head)``, the runs join
it instead (Flower's existing-cluster path, docs/scaling.md) and it is primed for each next
run; their actors are still their own (a run's Ray job ends with it).
``launch.federation.warm_federation`` pairs it with a SuperLink and a fork server.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch.processes import free_port, stop_process_groups

STARTED = "Ray runtime started."
# What each of the head's Python workers imports when it starts: Flower's simulation actor
# and PyTorch, which each actor would otherwise import when its run needs it
WORKER_PRELOAD = "torch,flwr.clientapp,flwr.simulation.ray_transport.ray_actor"
PRIMED_FOR_SECONDS = 60  # how long primed workers wait for a run before Ray may stop them
# A driver that joins and leaves, to check that the head takes drivers. No task: its worker
# would import WORKER_PRELOAD, and no run could use it (each run's job has a runtime
# environment of its own)
TRIAL_DRIVER = ("import sys, ray; ray.init(address=sys.argv[1], include_dashboard=False); "
                "ray.shutdown()")
# What ``prime`` asks the raylet with, imported as the head starts, not first in ``prime``'s
# background thread: a first import of Ray registers ~70 loggers, and pytest walks logging's
# registry unlocked as each test phase starts ("dictionary changed size during iteration")
PRIME_MODULES = ("grpc", "ray._raylet", "ray.core.generated.common_pb2",
                 "ray.core.generated.node_manager_pb2", "ray.core.generated.node_manager_pb2_grpc",
                 "ray.core.generated.runtime_environment_pb2")
HEAD_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_preload_python_modules": WORKER_PRELOAD,
            # By default Ray starts a worker per CPU for the first driver to join (workers no
            # run can use, as above) and holds that driver's join until they have started
            "RAY_prestart_worker_first_driver": "0"}


def gpus_per_client(device: str) -> float:
    """Each simulated client's share of the GPU for the app's ``device`` key on a federation
    whose Ray head offers the machine's CPUs, one a client: with ``cuda``, one over the CPUs,
    so that as many clients train at once as without a GPU, all on it (Ray hides the GPU
    from a client given no share); else none."""
    return 1 / (os.cpu_count() or 1) if device.startswith("cuda") else 0.0


class RayHead:
    """``ray start --head --block`` on a free port (context manager); stopped, with every
    process it started, on exit. Its workers import ``WORKER_PRELOAD`` as they start, and
    ``prime`` starts the next run's workers ahead of it."""

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
                env={**os.environ, **HEAD_ENV})
        deadline = time.monotonic() + 120
        while STARTED not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-1:]
                self.__exit__(None, None, None)
                raise RuntimeError(f"ray start --head failed: {' '.join(tail) or 'no output'}")
            time.sleep(0.2)
        # A trial driver joins first, so that a head that takes no driver fails here, with
        # Ray's reason. It was first added because, with three heads started at once on
        # 2 cores, the first run on two of them failed: its flwr-simulation process, the
        # head's first driver, sent its SuperLink no heartbeat for a minute while Ray held
        # its join (see HEAD_ENV). With the trial driver first, 9 runs of 9 completed.
        try:
            subprocess.run([sys.executable, "-c", TRIAL_DRIVER, self.address], check=True,
                           timeout=300, capture_output=True, text=True,
                           env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
            self.__exit__(None, None, None)
            raise RuntimeError(f"the Ray head at {self.address} took no driver: "
                               f"{driver_failure(error)}") from None
        for name in PRIME_MODULES:
            importlib.import_module(name)
        return self

    def prime(self) -> None:
        """Start one idle worker per CPU, in the background, for a run like the last one.

        Flower's simulation gives its Ray job a runtime environment (the ServerApp's
        ``PYTHONPATH``), so its actors cannot take the head's ordinary idle workers: each run
        started its own and waited for them to import Flower and PyTorch (3-4 s of a warm run
        on 2 cores). The next run of the same app has the same environment; workers started
        for it now are ready when its actors are created. Asked of the head's raylet
        (``PrestartWorkers``); a head that cannot be asked runs as before."""
        import grpc
        from ray._raylet import GcsClient
        from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc
        from ray.core.generated.runtime_environment_pb2 import RuntimeEnvInfo

        try:
            gcs = GcsClient(address=self.address)
            jobs = [job for job in gcs.get_all_job_info().values()
                    if job.config.runtime_env_info.serialized_runtime_env not in ("", "{}")]
            if not jobs:
                return
            last = max(jobs, key=lambda job: job.start_time)
            node = next(iter(gcs.get_all_node_info().values()))
            with grpc.insecure_channel(
                    f"{node.node_manager_address}:{node.node_manager_port}") as channel:
                node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(
                    node_manager_pb2.PrestartWorkersRequest(
                        language=common_pb2.PYTHON,
                        runtime_env_info=RuntimeEnvInfo(serialized_runtime_env=(
                            last.config.runtime_env_info.serialized_runtime_env)),
                        keep_alive_duration_secs=PRIMED_FOR_SECONDS,
                        num_workers=int(node.resources_total.get("CPU", 1))), timeout=10)
        except Exception as error:  # priming only saves time: it never fails a run
            with self.log.open("a") as log:
                log.write(f"priming the next run's workers failed: {error!r}\n")

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
