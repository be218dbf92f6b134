"""Run the app as ``flwr run`` does, on a private, self-stopping local SuperLink.

``flwr run .`` against ``:local:`` normally spawns a detached SuperLink on fixed ports that
outlives the run and is shared by everyone on the host. Tests, benchmarks and the demo script
instead start their own ``flower-superlink --simulation`` on free ports with their own
``FLWR_HOME`` (the CLI finds it by port, exactly as it finds its managed one), and stop it,
with every process it started, on exit. A run is started in-process with the requests
``flwr run --stream`` sends to the SuperLink's Control API (``LocalFederation.flwr_run``);
``flwr`` itself works against the same SuperLink (``flwr ls``, ``flwr log``). ``ray_address``
(``--ray-address``) attaches the simulation to a running Ray cluster instead of a private Ray
instance: the SuperLink and its ``flwr-simulation`` get ``RAY_ADDRESS``.

    with LocalFederation() as federation:
        completed = federation.run(".", {"method": "fedper"}, num_supernodes=4)

Command line (used by scripts/demo.sh):  python -m launch.federation [--supernodes N]
[--cpus-per-client C] [--gpus-per-client G] [--ray-address HOST:PORT] [key=value ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from common.config import ConfigError
from launch.app_project import app_defaults, bundle_files
from launch.control_api import LogStream, finished, list_runs, run_record, start_run
from launch.processes import (
    exit_on_sigterm,
    for_terminal_only,
    free_port,
    stop_process_groups,
    uncoloured,
    wait_until_serving,
)
from launch.ray_head import RayHead
from launch.run_config import check_run_config, parse_overrides
from launch.run_output import FAILED_WITH, RAY_GPU_TIP, FlowerRun, exit_with, mark, save_run_log
from launch.warm_start import ForkServer

SUPEREXEC_POLL_SECONDS = 0.1  # how soon a submitted run's process starts (Flower's: 1 s)
STATUS_POLL_SECONDS = 0.25  # how often a run's status is read while it runs
STREAM_GRACE_SECONDS = 10.0  # for a finished run's last lines (the stream's 0.5 s tick)


class LocalFederation:
    """A private simulation SuperLink for ``flwr run`` (context manager)."""

    def __init__(self, home: str | Path | None = None, ray_address: str | None = None,
                 pythonpath: Sequence[str | Path] = (),
                 forkserver: ForkServer | None = None, ray_head: RayHead | None = None,
                 superexec_poll_seconds: float | None = None) -> None:
        # runs join a Ray head of ours (primed for the next run after each), or the cluster
        # at ray_address, or start a private Ray instance each
        if ray_head is not None and ray_address is not None:
            raise ValueError("ray_head or ray_address, not both")
        self.ray_head = ray_head
        self.ray_address = ray_head.address if ray_head is not None else ray_address
        # Flower's flwr-simulation (and a SuperNode's flwr-clientapp) forked warm from it
        self.forkserver = forkserver
        # folders the app's processes import from besides the app (a user's model module):
        # Flower hands the PYTHONPATH on to its Ray workers
        self.pythonpath = [str(Path(folder).resolve()) for folder in pythonpath]
        # each poll a request: an idle SuperLink's CPU, 4.6 s a minute at 0.1 s, 0.7 s at 1 s
        self.superexec_poll_seconds = (SUPEREXEC_POLL_SECONDS if superexec_poll_seconds is None
                                       else superexec_poll_seconds)
        self._tmp = tempfile.TemporaryDirectory(prefix="flwr-home-") if home is None else None
        self.home = Path(home or self._tmp.name)
        self.http_port, self.control_port = free_port(), free_port()
        self.process: subprocess.Popen | None = None
        self._previous_sigterm: Any = None
        self._unfinished: set[str] = set()  # runs started and not seen to finish

    @property
    def env(self) -> dict[str, str]:
        bin_dir = str(Path(sys.executable).parent)
        # Ray's own variable: ray.init() in flwr-simulation, called without an address, joins
        # the cluster it names (Flower 1.42 has no backend option for the address).
        ray_env = {"RAY_ADDRESS": self.ray_address} if self.ray_address is not None else {}
        inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
        path_env = ({"PYTHONPATH": os.pathsep.join([*self.pythonpath, *inherited])}
                    if self.pythonpath else {})
        warm = self.forkserver.env() if self.forkserver is not None else {}
        warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), RAY_GPU_TIP]))
        return {**os.environ, **ray_env, **path_env, **warm, "PYTHONWARNINGS": warnings,
                "PATH": os.pathsep.join([*filter(None, [warm.get("PATH")]), bin_dir,
                                         os.environ.get("PATH", "")]),
                "FLWR_HOME": str(self.home),
                "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(self.http_port),
                "FLWR_LOCAL_CONTROL_API_PORT": str(self.control_port),
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_TELEMETRY_ENABLED": "0",
                "RAY_DEDUP_LOGS": "0",
                "PYTHONUNBUFFERED": "1",
                "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(self.superexec_poll_seconds)}

    def __enter__(self) -> LocalFederation:
        self.start()
        self.wait_ready()
        return self

    def start(self) -> None:
        """Start the SuperLink, without waiting for it (``wait_ready``); ``__exit__`` stops
        it. The demo's launcher checks the run config meanwhile."""
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (kill, timeout) would skip __exit__ and orphan the SuperLink: turn it
            # into SystemExit so that the `with` block still stops what it started.
            self._previous_sigterm = signal.signal(signal.SIGTERM, exit_on_sigterm)
        self.home.mkdir(parents=True, exist_ok=True)
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
        with open(self.home / "superlink.log", "ab") as log:
            self.process = subprocess.Popen(
                ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
                 "--control-api-address", f"127.0.0.1:{self.control_port}",
                 "--host", "127.0.0.1", "--port", str(self.http_port)],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self) -> None:
        """Until the started SuperLink answers (at most 60 s; else stopped, and raises)."""
        why = wait_until_serving(self.process, f"http://127.0.0.1:{self.http_port}/health", 60)
        if why == "exited":
            raise RuntimeError(f"flower-superlink exited; see {self.home}/superlink.log")
        if why is not None:
            self.__exit__(None, None, None)
            raise RuntimeError(f"flower-superlink {why}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            # The SuperLink runs in its own session: stop it and every process it started
            # (the SuperExec's session with flwr-simulation and Ray included). Once every run
            # has finished that session holds a finished run's flwr-simulation at most, its
            # outcome sent and Ray stopped, winding PyTorch down (2 s on 2 cores): killed
            stop_process_groups(self.process, 15, kill_others=not self._unfinished)
        if self._tmp is not None:
            self._tmp.cleanup()
        if self._previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def run(self, app_dir: str | Path, run_config: dict[str, Any] | None = None, *,
            num_supernodes: int = 4, cpus_per_client: int = 1, gpus_per_client: float = 0.0,
            timeout: float = 900, echo: bool = False) -> FlowerRun:
        """``flwr run APP --stream`` with ``run_config`` overrides, checked first
        (``launch.run_config.check_run_config``: a bad config raises its one-line
        ``ConfigError`` before Ray starts); returns when the run ends."""
        check_run_config(run_config or {}, app_dir, num_supernodes)
        return self.flwr_run(app_dir, run_config, self.federation_config(
            num_supernodes, cpus_per_client, gpus_per_client), timeout=timeout, echo=echo)

    @staticmethod
    def federation_config(num_supernodes: int, cpus_per_client: int,
                          gpus_per_client: float) -> dict[str, Any]:
        """The simulation's size and each client's resources, as ``flwr run
        --federation-config`` takes them."""
        return {"num-supernodes": num_supernodes, "client-resources-num-cpus": cpus_per_client,
                "client-resources-num-gpus": float(gpus_per_client)}

    def flwr_run(self, app_dir: str | Path, run_config: dict[str, Any] | None,
                 federation: dict[str, Any], *, timeout: float = 900, echo: bool = False
                 ) -> FlowerRun:
        """What ``flwr run APP --stream --federation-config ...`` does on the default
        connection, asked in-process through the SuperLink's Control API, the run config
        unchecked (the ServerApp's own check is all there is, as with a plain ``flwr run``):
        the app bundled (Flower's ``build_fab_from_disk``, which validates its
        ``pyproject.toml``), the run started (``StartRun``), its log streamed
        (``StreamLogs``) until the SuperLink ends the stream at the run's end. A ``flwr run``
        process cost each run about 1 s of CPU for its imports. ``federation``: the
        simulation's size and resources, ``federation_config``'s keys.

        A run that ends in failure still ends its stream normally, so the run's final
        status, and why it failed, are read back from the SuperLink (``runs``)."""
        import httpx

        staged = bundle_files(app_dir, self.home / f"app-{time.monotonic_ns()}")
        try:
            with self.control_client() as control:
                run_id = str(start_run(control, staged, run_config or {}, federation))
        except (ValueError, OSError, httpx.HTTPError) as error:  # what `flwr run` reports
            return FlowerRun(1, f"flwr run: {error}\n", None, "")
        finally:
            if staged != Path(app_dir):
                shutil.rmtree(staged, ignore_errors=True)
        self._unfinished.add(run_id)
        primed = threading.Lock()  # held once the next run's workers have been asked for
        stream = LogStream(self.control_client, run_id, echo, lambda: self._prime(primed))
        stream.start()
        run, unread = self._wait_for_end(stream, run_id, time.monotonic() + timeout)
        return self._ending(run, unread, run_id, stream.output(), primed, timeout)

    def _wait_for_end(self, stream: LogStream, run_id: str, deadline: float
                      ) -> tuple[dict[str, str] | None, str]:
        """Until the run ends (the stream ends, or the SuperLink records the end), the
        deadline passes or the SuperLink exits; the run's record then (None, and why)."""
        with self.control_client() as control:
            while stream.reading() and time.monotonic() < deadline and self._superlink_alive():
                stream.wait(STATUS_POLL_SECONDS)
                # a stream that broke off (a dropped connection) does not end the wait: the
                # SuperLink's record of the run's end does
                if stream.reading() and finished(control, run_id):
                    stream.wait(STREAM_GRACE_SECONDS)  # the last lines on their way
                    break
            while (not stream.reading() and not stream.ended.is_set()
                   and time.monotonic() < deadline and self._superlink_alive()
                   and not finished(control, run_id)):
                time.sleep(STATUS_POLL_SECONDS)
            run, unread = (run_record(control, run_id) if self._superlink_alive()
                           else (None, ""))
            if run is None and self.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5)  # a SuperLink stopping refuses connections first
        return run, unread

    def _ending(self, run: dict[str, str] | None, unread: str, run_id: str, output: str,
                primed: threading.Lock, timeout: float) -> FlowerRun:
        """How the run ended, from its record: unknown (the SuperLink gone or mute),
        past its timeout (then stopped), or finished with Flower's status and reason."""
        import httpx

        if run is None:
            why = (f"the SuperLink exited during the run (see {self.home}/superlink.log)"
                   if not self._superlink_alive()
                   else f"the run's status could not be read: {unread}")
            return FlowerRun(1, output + f"flwr run: {why}\n", run_id, "", why)
        self._prime(primed)
        if not run["status"].startswith("finished"):
            # past its timeout: the run is stopped, not left running beside the next one
            # (Flower ends its process at the process's next heartbeat, within half a minute)
            try:
                self.stop(run_id)
            except (OSError, httpx.HTTPError) as error:
                output += f"flwr run: stopping the run failed: {error}\n"
            return FlowerRun(124, output + f"flwr run: no end within {timeout:.0f} s\n",
                             run_id, run["status"])
        status = run["status"]
        self._unfinished.discard(run_id)
        details = run.get("status-details", "") if status != "finished:completed" else ""
        return FlowerRun(0, output, run_id, status, FAILED_WITH.sub("", details))

    def _superlink_alive(self) -> bool:
        """False once the SuperLink this federation started has exited (one it joined is
        taken to be up)."""
        return self.process is None or self.process.poll() is None

    def _prime(self, primed: threading.Lock) -> None:
        """Have the Ray head start the next run's workers (once a run, in the background):
        as soon as the ServerApp has written its results, while Flower winds the run down.
        ``primed``: the run's lock, taken by the first call (the stream reader's or the
        waiting thread's)."""
        if self.ray_head is not None and primed.acquire(blocking=False):
            threading.Thread(target=self.ray_head.prime, daemon=True).start()

    def control_client(self) -> Any:
        """The SuperLink's Control API, reached as ``flwr`` reaches it: through the default
        connection in ``FLWR_HOME/config.toml`` (``:local:`` is this federation's own port).
        Asked in-process: a ``flwr ls`` process costs about 1 s, the request 0.02 s. A
        context manager: leaving it closes its HTTP connections."""
        from flwr.cli.cli_client_interceptor import CliClientHttpInterceptor
        from flwr.supercore.control import ControlHttpClient
        from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor

        superlinks = tomllib.loads((self.home / "config.toml").read_text())["superlink"]
        connection = superlinks[superlinks["default"]]
        address = connection["address"]
        local = address.startswith(":local")
        return ControlHttpClient.from_server_address(
            f"127.0.0.1:{self.http_port}" if local else address,
            insecure=local or connection.get("insecure", False),
            root_certificates=connection.get("root-certificates"),
            interceptors=[CliClientHttpInterceptor(),
                          RuntimeVersionHttpInterceptor(component_name="flwr CLI")])

    def runs(self, run_id: str | None = None) -> list[dict[str, str]]:
        """Every run the SuperLink knows, or just ``run_id`` (none if it does not know it):
        ``flwr ls --format json``'s entries, each a dict with ``run-id``, ``status`` (e.g.
        ``finished:completed``) and ``status-details``."""
        with self.control_client() as control:
            return list_runs(control, run_id)

    def stop(self, run_id: str) -> None:
        """What ``flwr stop RUN_ID`` asks: the SuperLink stops the run's ServerApp."""
        from flwr.proto.control_pb2 import StopRunRequest

        with self.control_client() as control:
            control.StopRun(StopRunRequest(run_id=int(run_id)))


@contextlib.contextmanager
def warm_federation(pythonpath: Sequence[str | Path] = (), forkserver: ForkServer | None = None,
                    ray_address: str | None = None, ray_cpus: int | None = None,
                    superexec_poll_seconds: float | None = None) -> Iterator[LocalFederation]:
    """A private SuperLink whose runs join one Ray cluster kept up between them (a Ray head of
    its own, or the one at ``ray_address``), their ``flwr-simulation`` processes forked from a
    fork server (``forkserver``, or one of its own): one run after another skips Ray's start
    and Flower's imports (warm runs). The fork server and the Ray head start in threads
    while the SuperLink starts; what it started is stopped on exit. ``pythonpath``: as for
    ``LocalFederation``. ``ray_cpus``: how many CPUs the Ray head of its own offers (default:
    the machine's), which is how many ClientApp actors each run starts, each in a worker of
    its own. ``superexec_poll_seconds``: as for ``LocalFederation``.

    Not for one run: there a Ray head's start and stop cost more than the private Ray
    instance Flower starts inside the run, and the fork server's imports, on 2 busy cores,
    as much as those it saves (measured on the demo: no faster)."""
    if ray_cpus is not None and ray_address is not None:
        raise ValueError("ray_cpus is for a Ray head of its own, not the one at ray_address")
    with contextlib.ExitStack() as started:
        forks = forkserver or ForkServer()
        head = RayHead(num_cpus=ray_cpus) if ray_address is None else None
        federation = LocalFederation(ray_address=ray_address, ray_head=head,
                                     pythonpath=pythonpath, forkserver=forks,
                                     superexec_poll_seconds=superexec_poll_seconds)
        # started here, beside the SuperLink: the ones this call owns
        starting = [helper for helper in (forks, head)
                    if helper is not None and helper is not forkserver]
        entered: list[ForkServer | RayHead] = []
        failures: list[BaseException] = []

        def enter(helper: ForkServer | RayHead) -> None:
            try:
                helper.__enter__()
                entered.append(helper)
            except BaseException as error:  # raised below, in the caller's thread
                failures.append(error)

        threads = [threading.Thread(target=enter, args=(helper,)) for helper in starting]
        for thread in threads:
            thread.start()
        try:
            federation.__enter__()
        finally:
            for thread in threads:
                thread.join()
            for helper in entered:  # stopped after the SuperLink, as they were started
                started.push(helper)
        started.push(federation)
        if failures:
            raise failures[0]
        yield federation


def main() -> None:
    """The demo's launcher: the overrides read and checked (one line and exit 2 on a
    mistake: the general keys before anything starts, the method, model and partition while
    the SuperLink starts, which is then stopped), the run, then its outcome in one line: exit
    0 only for ``finished:completed``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", default=".")
    parser.add_argument("--supernodes", type=int, default=10)
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=0.0)
    parser.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                        help="run the clients on this running Ray cluster (its GCS address, "
                             "as `ray start --head` prints it); see docs/scaling.md")
    parser.add_argument("overrides", nargs="*",
                        help="run-config overrides as key=value (method=fedper, lr=0.1)")
    args = parser.parse_args()
    sys.stdout = for_terminal_only(sys.stdout)  # the echo: colours for a terminal only
    federation, refused = LocalFederation(ray_address=args.ray_address), None
    try:
        overrides = parse_overrides(args.overrides, app_defaults(Path(args.app).resolve()))
        # the SuperLink (2 s) starts once the general keys are checked, beside the method's
        # check and the partition's draw (4 s: PyTorch here, datasets in a forked child)
        check_run_config(overrides, args.app, args.supernodes, meanwhile=federation.start,
                         fork=True)
        mark("config checked")
        federation.wait_ready()
        run = federation.flwr_run(args.app, overrides, federation.federation_config(
            args.supernodes, args.cpus_per_client, args.gpus_per_client), echo=True)
    except ConfigError as error:
        refused = error
    finally:
        federation.__exit__(None, None, None)  # what it started, if anything: stopped
    if refused is not None:
        exit_with(2, f"pflower: {refused}", sys.stderr)
    saved = save_run_log(uncoloured(run.output))  # a file: never coloured
    stream = sys.stdout if run.ok else sys.stderr
    if saved:  # the whole stream, the lines left out of the terminal included
        print(f"full log: {saved}", file=stream)
    exit_with(0 if run.ok else 1, f"run {run.run_id}: {run.status or 'not started'}"
              + (f": {run.reason}" if run.reason else ""), stream)


if __name__ == "__main__":
    main()
