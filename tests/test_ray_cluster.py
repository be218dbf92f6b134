"""Integration: a simulation whose Ray backend joins a running two-node Ray cluster.

docs/scaling.md describes the procedure; this test carries it out on one machine:

- a Ray head and a Ray worker node, each ``ray start ... --block`` with 1 CPU and its own
  ``--temp-dir`` (hence its own log directory);
- a private SuperLink (``LocalFederation(ray_address=...)``, which puts ``RAY_ADDRESS`` into the
  environment of the ``flwr-simulation`` process) runs ``flwr run`` with 4 SuperNodes for
  2 rounds, one CPU per client;
- checked from Ray: ``ray status`` lists two nodes, a ``ClientAppActor`` worker process ran on
  each node (each node's own log directory holds one), the simulation process was a driver of
  this cluster (its ``python-core-driver-*.log`` is in a node's log directory), and it started
  no Ray instance of its own (``RAY_TMPDIR``, where it would have put one, stays empty).

Loopback only: everything runs in a new network namespace whose only interface is ``lo``
(``unshare --net``). Outside one, Ray replaces 127.0.0.1 by the address of the host's default
route (``ray._private.services.resolve_ip_for_localhost``), so a loopback-only multi-node
cluster is impossible on a host that has a network. The namespace is a new PID namespace too:
when its first process ends (normally, on an error, or killed by the timeout) the kernel kills
every process left in it, so no Ray or Flower process outlives the test.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import check_results_schema, read_results

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
OUTER_TIMEOUT = 480  # the whole sandbox; a normal run takes 2-3 minutes on 2 busy cores
RUN_TIMEOUT = 240  # the flwr run inside it
ACTOR_MARK = ":actor_name:ClientAppActor"  # first line Ray writes to an actor's worker-*.out


def _sandbox() -> list[str] | str:
    """``unshare`` arguments for a loopback-only network + PID namespace, or why there is none."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return "needs util-linux `unshare` for a loopback-only network namespace"
    command = [unshare, "--net", "--pid", "--fork", "--mount-proc", "--kill-child"]
    if os.geteuid() != 0:
        command[1:1] = ["--user", "--map-root-user"]
    try:
        probe = subprocess.run([*command, sys.executable, "-c", "import socket; "
                                "print([n for _, n in socket.if_nameindex()])"],
                               capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "cannot create a loopback-only network namespace (unshare timed out)"
    if probe.returncode != 0 or probe.stdout.strip() != "['lo']":
        why = (probe.stderr.strip().splitlines() or [probe.stdout.strip()])[-1]
        return f"cannot create a loopback-only network namespace: {why}"
    return command


def test_simulation_runs_on_an_existing_two_node_ray_cluster(tmp_path):
    sandbox = _sandbox()
    if isinstance(sandbox, str):
        pytest.skip(sandbox)
    # Ray's Unix sockets live under --temp-dir and must stay below ~107 characters.
    work = Path(tempfile.mkdtemp(prefix="raycl-", dir="/tmp"))
    started = time.monotonic()
    try:
        completed = subprocess.run(
            [*sandbox, sys.executable, "-m", "tests.test_ray_cluster", str(work), str(tmp_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=OUTER_TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"sandbox ran past {OUTER_TIMEOUT} s (killed with everything in it): "
                    f"{(exc.stdout or b'')[-3000:]!r}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started
    report_file = tmp_path / "report.json"
    context = f"{completed.stdout[-4000:]}\n{completed.stderr[-4000:]}"
    assert report_file.exists(), context
    report: dict[str, Any] = json.loads(report_file.read_text())
    if report.get("skip"):
        pytest.skip(report["skip"])
    context = f"{json.dumps(report, indent=1)[-6000:]}\n{context}"
    assert completed.returncode == 0, context
    assert report["nodes_before_run"] == 2, context
    assert report["run_status"] == "finished:completed", context
    # a ClientAppActor process ran on the head node and one on the worker node, and the
    # simulation's driver (flwr-simulation) was connected to one of the two
    assert report["actor_logs"]["head"] and report["actor_logs"]["worker"], context
    assert report["driver_logs"]["head"] + report["driver_logs"]["worker"], context
    # ... and the actors belong to that driver's Ray job
    actor_jobs = {re.search(r"-([0-9a-f]{8})-\d+\.out$", name).group(1)
                  for names in report["actor_logs"].values() for name in names}
    driver_jobs = {re.search(r"python-core-driver-([0-9a-f]{8})", name).group(1)
                   for names in report["driver_logs"].values() for name in names}
    assert actor_jobs <= driver_jobs, context
    assert report["private_ray_sessions"] == [], context
    assert report["left_running_after_teardown"] == [], context
    check_results_schema(read_results(tmp_path / "results"), "fedavg", num_rounds=2,
                         num_clients=4)
    print(f"two-node Ray cluster run: {elapsed:.0f} s; phases {report['phases']}")


# ---- inside the sandbox (python -m tests.test_ray_cluster WORK OUT) -------------------------


def _bring_loopback_up() -> None:
    """``ip link set lo up`` without iproute2 (a new network namespace starts with lo down)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sH22x", b"lo", flags | iff_up))


def _ray_start(args: list[str], temp_dir: Path, log: Path) -> subprocess.Popen:
    """``ray start ... --block``: the command stays in the foreground and, on SIGTERM, stops
    every process of its node."""
    ray = str(Path(sys.executable).parent / "ray")
    return subprocess.Popen(
        [ray, "start", *args, "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
         f"--temp-dir={temp_dir}", "--disable-usage-stats", "--block"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_started(process: subprocess.Popen, log: Path, timeout: float) -> str | None:
    """None once the node is up, else the last line of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "Ray runtime started." in text:
            return None
        if process.poll() is not None:
            break
        time.sleep(0.5)
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else f"no output (exit code {process.poll()})"


def _active_nodes(address: str) -> tuple[int, str]:
    """How many nodes ``ray status`` lists as active, and its output."""
    ray = str(Path(sys.executable).parent / "ray")
    status = subprocess.run([ray, "status", f"--address={address}"], capture_output=True,
                            text=True, timeout=60)
    active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
    count = sum(int(n) for n in re.findall(r"^\s*(\d+)\s+node_[0-9a-f]+", active, re.M))
    return count, status.stdout + status.stderr


def _ray_logs(temp_dir: Path, pattern: str, containing: str = "") -> list[str]:
    """The node's log files named ``pattern`` (and containing ``containing``)."""
    logs = (temp_dir / "session_latest" / "logs").glob(pattern)
    return sorted(p.name for p in logs if containing in p.read_text(errors="replace"))


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each process group, then SIGKILL to those still there after 30 s."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        alive = [p for p in processes if p.poll() is None]
        for process in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
        deadline = time.monotonic() + wait
        for process in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))


def _running_processes() -> list[str]:
    """Every live process of this PID namespace but this one (zombies aside)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, IndexError):
            continue
        if state != "Z" and command:
            found.append(command[:200])
    return found


def _inside(work: Path, out: Path) -> int:
    from launch.federation import LocalFederation
    from launch.processes import free_port

    started = time.monotonic()
    report: dict[str, Any] = {"phases": {}}

    def phase(name: str) -> None:
        report["phases"][name] = round(time.monotonic() - started, 1)
        print(f"[{report['phases'][name]:6.1f} s] {name}", flush=True)

    def save() -> None:
        (out / "report.json").write_text(json.dumps(report, indent=1))

    nodes: dict[str, subprocess.Popen] = {}
    try:
        _bring_loopback_up()
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        # Where a Ray instance started by the simulation itself would put its session.
        os.environ["RAY_TMPDIR"] = str(work / "default")
        address = f"127.0.0.1:{free_port()}"
        nodes["head"] = _ray_start(["--head", f"--port={address.rsplit(':', 1)[1]}",
                                    "--include-dashboard=false"], work / "head",
                                   out / "ray-head.log")
        failure = _wait_started(nodes["head"], out / "ray-head.log", 120)
        if failure is not None:
            report["skip"] = f"ray cannot start a head node here: {failure}"
            return 0
        phase("head started")
        nodes["worker"] = _ray_start([f"--address={address}"], work / "worker",
                                     out / "ray-worker.log")
        failure = _wait_started(nodes["worker"], out / "ray-worker.log", 120)
        assert failure is None, f"ray worker node did not start: {failure}"
        deadline = time.monotonic() + 60
        while True:
            report["nodes_before_run"], report["status_before_run"] = _active_nodes(address)
            if report["nodes_before_run"] >= 2 or time.monotonic() > deadline:
                break
            time.sleep(2)
        phase("worker joined")

        home = out / "flwr-home"
        with LocalFederation(home=home, ray_address=address) as federation:
            run = federation.run(ROOT, {"num-server-rounds": 2, "local-epochs": 1,
                                        "plot": False, "output-dir": str(out / "results")},
                                 num_supernodes=4, cpus_per_client=1, timeout=RUN_TIMEOUT)
        report["run_status"] = run.status
        report["run_output_tail"] = run.output[-3000:]
        phase("flwr run finished")
        report["actor_logs"] = {name: _ray_logs(work / name, "worker-*.out", ACTOR_MARK)
                                for name in ("head", "worker")}
        # flwr-simulation was a driver of this cluster: its core worker logged on a node here.
        report["driver_logs"] = {name: _ray_logs(work / name, "python-core-driver-*.log")
                                 for name in ("head", "worker")}
        report["private_ray_sessions"] = sorted(
            str(p) for p in (work / "default").glob("**/session_*"))
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _stop(list(nodes.values()))
        report["left_running_after_teardown"] = _running_processes()
        phase("torn down")
        save()
    return 0


if __name__ == "__main__":
    sys.exit(_inside(Path(sys.argv[1]), Path(sys.argv[2])))
