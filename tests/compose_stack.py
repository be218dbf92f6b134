"""The docker-compose deployment driven exactly as README "Deployment" says (``deploy/up.sh
start``, ``flwr run . pflower-compose``, ``deploy/up.sh stop``), in a private folder, port,
compose project and FLWR_HOME, so that tests can bring it up, attack it and always take it
down again (containers, networks, and a dockerd that ``start`` started).

    with ComposeStack("insecure", tmp_path) as stack:
        run = stack.run(ROOT, {"method": "fedper"})
        stack.kill("supernode-2"); stack.start("supernode-2")
"""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from launch.control_api import list_runs, run_log
from launch.federation import FlowerRun, LocalFederation
from launch.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
UP = str(ROOT / "deploy" / "up.sh")
CANNOT_START_DOCKER = 3  # deploy/docker-engine.sh: no engine and no way to start one here


class DockerUnavailableError(RuntimeError):
    """Docker cannot be started on this machine (the reason is the message)."""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


class ComposeStack(LocalFederation):
    def __init__(self, profile: str, base: Path) -> None:
        # the SuperExecs poll at Flower's 1 s, not the compose file's 0.2 s: the TLS test
        # then costs 150 s of CPU instead of 173 (containers and host), each round a second
        # longer at most
        super().__init__(base / "flwr-home", superexec_poll_seconds=1.0)
        self.profile = profile
        self.dir = base / "deploy"        # PFLOWER_DIR: state, outputs, sites, certs, keys
        self.port = free_port()
        self.project = f"pfltest{secrets.token_hex(3)}"
        self.log = base / "stack.log"

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "PFLOWER_DIR": str(self.dir), "PFLOWER_PORT": str(self.port),
                "COMPOSE_PROJECT_NAME": self.project, "PYTHON": sys.executable}

    def _up(self, step: str, timeout: float) -> subprocess.CompletedProcess:
        with open(self.log, "a") as log:
            log.write(f"\n$ deploy/up.sh {step} {self.profile}\n")
            log.flush()
            return subprocess.run(["bash", UP, step, self.profile], cwd=ROOT, env=self.env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  check=False)

    def _log_tail(self, lines: int) -> str:
        return "\n".join(self.log.read_text().strip().splitlines()[-lines:])

    def __enter__(self) -> ComposeStack:
        if threading.current_thread() is threading.main_thread():
            # a SIGTERM (timeout, kill) must still take the stack down
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            started = self._up("start", timeout=1800)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        if started.returncode != 0:
            self.__exit__(None, None, None)
            if started.returncode == CANNOT_START_DOCKER:
                raise DockerUnavailableError(self._log_tail(1))
            raise RuntimeError(f"deploy/up.sh start {self.profile} failed:\n"
                               f"{self._log_tail(30)}\n(see {self.log})")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            stopped = self._up("stop", timeout=300)
            assert stopped.returncode == 0, self._log_tail(30)
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    # ------------------------------------------------------------------ the stack
    def run(self, app_dir: str | Path, run_config: dict[str, Any] | None = None, *,
            timeout: float = 1200, echo: bool = False, **_: Any) -> FlowerRun:
        """``flwr run APP --stream`` on the stack's connection (its FLWR_HOME's default).

        The CLI runs in a daemon thread that this one joins in short steps, so that a SIGTERM
        (as SystemExit) reaches the caller at once and the stack is taken down, which ends
        the CLI's stream."""
        result: dict = {}
        runner = threading.Thread(daemon=True, target=lambda: result.update(
            run=self.flwr_run(app_dir, run_config, {}, timeout=timeout, echo=echo)))
        runner.start()
        while runner.is_alive():
            runner.join(1.0)
        return result["run"]

    def wait_ready(self, timeout: float = 120) -> None:
        """Until the SuperLink answers what ``flwr ls`` asks (after a ``compose up``), asked
        in-process: a ``flwr ls`` process a second cost 12.6 s of CPU in a 33 s wait."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:
            try:
                self.runs()
                return
            except (OSError, httpx.HTTPError):
                assert time.monotonic() < deadline, "the SuperLink did not answer"
                time.sleep(1)

    def container(self, service: str) -> str:
        """The id of the service's container (running or not)."""
        found = self.docker("ps", "-aq", "--filter",
                            f"label=com.docker.compose.project={self.project}", "--filter",
                            f"label=com.docker.compose.service={service}").stdout.split()
        assert len(found) == 1, (service, found)
        return found[0]

    def docker(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True,
                              check=check, timeout=300)

    def compose(self, *args: str) -> subprocess.CompletedProcess:
        """``docker compose`` (or ``docker-compose``) on this stack's file, profile, project."""
        command = (["docker", "compose"] if self.docker("compose", "version", check=False)
                   .returncode == 0 else ["docker-compose"])
        return subprocess.run([*command, "-f", str(ROOT / "docker-compose.yml"), "--profile",
                               self.profile, *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, check=True, timeout=300)

    def kill(self, service: str) -> None:
        """SIGKILL the service's container (a crash)."""
        self.docker("kill", "--signal", "KILL", self.container(service))

    def start(self, service: str) -> None:
        self.docker("start", self.container(service))

    def logs(self, service: str, since: float | None = None) -> str:
        args = ["logs", *(["--since", f"{since:.3f}"] if since else []), self.container(service)]
        done = self.docker(*args)
        return done.stdout + done.stderr

    def server_log(self) -> str:
        """What the running ServerApp has logged so far (what ``flwr log RUN_ID --show``
        prints), asked in-process: a ``flwr log`` process every 2 s cost 19 s of CPU. "" when
        it cannot be read now (no run yet, the SuperLink busy, no line within 30 s): the
        callers poll."""
        import httpx

        found: list[str] = []

        def read(control: object, run_id: str) -> None:
            with contextlib.suppress(OSError, httpx.HTTPError, ValueError):
                found.append(run_log(control, run_id))

        try:
            with self.control_client() as control:  # one client for both requests
                running = [r["run-id"] for r in list_runs(control, None)
                           if r["status"] == "running"]
                if len(running) != 1:
                    return ""
                reader = threading.Thread(target=read, args=(control, running[0]), daemon=True)
                reader.start()
                reader.join(30)  # leaving the block closes the client: a waiting read fails
        except (OSError, httpx.HTTPError):
            return ""
        return found[0] if found else ""

    def output(self, name: str) -> Path:
        """Host folder of the ServerApp's ``output-dir='outputs/<name>'``."""
        return self.dir / "outputs" / name
