"""A real multi-process deployment on this machine: ``flower-superlink`` plus N
``flower-supernode`` processes on loopback (each with its own port, node config and state
directory), optionally with TLS. ``flwr run`` then goes through the Deployment Runtime exactly
as against a remote SuperLink with real devices.

    with LocalDeployment(num_sites=3, certs_dir=None) as deployment:
        run = deployment.run(".", {"method": "fedper"})
        deployment.kill_site(1); deployment.start_site(1)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from common.local_federation import FlowerRun, LocalFederation, free_port


class LocalDeployment(LocalFederation):
    def __init__(self, num_sites: int = 3, certs_dir: str | Path | None = None,
                 home: str | Path | None = None) -> None:
        super().__init__(home)
        self.num_sites = num_sites
        self.certs_dir = Path(certs_dir) if certs_dir else None
        self.site_ports = [free_port() for _ in range(num_sites)]
        self.sites: dict[int, subprocess.Popen] = {}

    def _spawn(self, command: list[str], log_name: str) -> subprocess.Popen:
        log = open(self.home / log_name, "ab")  # noqa: SIM115 (outlives this call)
        return subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def state_dir(self, site: int) -> Path:
        return self.home / f"site-{site}-state"

    def __enter__(self) -> LocalDeployment:
        self.home.mkdir(parents=True, exist_ok=True)
        security = (["--ssl-ca-certfile", str(self.certs_dir / "ca.crt"),
                     "--ssl-certfile", str(self.certs_dir / "server.pem"),
                     "--ssl-keyfile", str(self.certs_dir / "server.key")]
                    if self.certs_dir else ["--insecure"])
        connection = (f'root-certificates = "{self.certs_dir / "ca.crt"}"' if self.certs_dir
                      else "insecure = true")
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.http_port}"\n{connection}\n')
        self.process = self._spawn(
            ["flower-superlink", *security, "--host", "127.0.0.1", "--port",
             str(self.http_port), "--database", str(self.home / "state.db"),
             "--disable-runtime-dependency-installation"], "superlink.log")
        self._wait_healthy()
        for site in range(self.num_sites):
            self.start_site(site)
        return self

    def _wait_healthy(self) -> None:
        scheme = "https" if self.certs_dir else "http"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flower-superlink exited; see {self.home}/superlink.log")
            try:
                import ssl

                context = (ssl.create_default_context(cafile=str(self.certs_dir / "ca.crt"))
                           if self.certs_dir else None)
                with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.http_port}/health",
                                            timeout=1, context=context):
                    return
            except OSError:
                time.sleep(0.3)
        self.__exit__(None, None, None)
        raise RuntimeError("flower-superlink did not become healthy within 60 s")

    def start_site(self, site: int) -> None:
        """Start (or restart) site ``site``'s SuperNode with its node config."""
        security = (["--root-certificates", str(self.certs_dir / "ca.crt")]
                    if self.certs_dir else ["--insecure"])
        node_config = (f"partition-id={site} num-partitions={self.num_sites} "
                       f"client-id='site-{site}' state-dir='{self.state_dir(site)}'")
        self.sites[site] = self._spawn(
            ["flower-supernode", *security, "--superlink", f"127.0.0.1:{self.http_port}",
             "--host", "127.0.0.1", "--port", str(self.site_ports[site]),
             "--node-config", node_config], f"site-{site}.log")

    def kill_site(self, site: int) -> None:
        """SIGKILL the site's SuperNode and everything it started (a crash)."""
        process = self.sites.pop(site)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)

    def __exit__(self, *exc: object) -> None:
        for site in list(self.sites):
            process = self.sites.pop(site)
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
        super().__exit__(*exc)

    def run(self, app_dir: str | Path, run_config: dict[str, Any] | None = None, *,
            timeout: float = 900, echo: bool = False, **_: Any) -> FlowerRun:
        """``flwr run APP --stream`` through the deployment's SuperLink."""
        return self.flwr_run(app_dir, run_config, [], timeout=timeout, echo=echo)
