"""A real multi-process deployment on this machine: ``flower-superlink`` plus N
``flower-supernode`` processes (each with its own port, node config and state directory),
optionally with TLS. ``flwr run`` then goes through the Deployment Runtime exactly as against a
remote SuperLink with real devices.

Sites talk to the SuperLink over loopback, or, with ``namespaces=True`` (needs ``ip netns``,
i.e. CAP_NET_ADMIN; see ``namespaces_available``), each site's SuperNode and the ClientApp
processes it starts run in their own network namespace with their own address
(``198.18.<k>.2``, RFC 2544 benchmarking space) behind a veth pair, so they reach the SuperLink
only over a network link, as separate machines would.

    with LocalDeployment(num_sites=3, certs_dir=None) as deployment:
        run = deployment.run(".", {"method": "fedper"})
        deployment.kill_site(1); deployment.start_site(1)
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from launch.federation import FlowerRun, LocalFederation
from launch.processes import free_port
from launch.run_config import check_run_config
from launch.warm_start import ForkServer


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def namespaces_available() -> bool:
    """Whether this machine lets us create network namespaces and veth pairs."""
    if shutil.which("ip") is None:
        return False
    probe = f"pflprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
        return True
    except (subprocess.CalledProcessError, OSError):
        return False


def write_node_key(private_path: Path) -> Path:
    """A SuperNode key pair for ``--auth-supernode-private-key`` (ECDSA P-384, OpenSSH
    format, as ``ssh-keygen -t ecdsa -b 384`` makes it); returns the public key's path."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    private_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                               serialization.PrivateFormat.OpenSSH,
                                               serialization.NoEncryption()))
    private_path.chmod(0o600)
    public_path = private_path.with_suffix(".pub")
    public_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                          serialization.PublicFormat.OpenSSH))
    return public_path


class LocalDeployment(LocalFederation):
    """``supernode_auth``: the SuperLink runs with ``--enable-supernode-auth`` (TLS needed),
    and each site's key is registered (``flwr supernode register``) under the name
    ``node_names[site]`` (default ``site-<k>``) before its SuperNode starts.
    ``client_ids[site]``: the client id a site says it is (default ``site-<k>``);
    ``start_sites``: the sites started on entering (default: all; start others with
    ``start_site``). ``site_threads``: the CPU threads each site's training may use
    (``OMP_NUM_THREADS`` of its SuperNode and the ClientApps it starts); default: this
    machine's cores shared out among the sites, as if each site were a machine of its own
    (PyTorch would otherwise give every site all cores); 0 leaves PyTorch's default.
    ``poll_interval``: how often each SuperExec looks for a message's work to start
    (``FLWR_SUPEREXEC_TASK_POLL_INTERVAL``; Flower's default is 1 s). ``forkserver``: the
    SuperNodes' ``flwr-clientapp`` processes (one per message) and the SuperLink's
    ``flwr-serverapp`` are forked warm from it (in a site's namespace, with ``namespaces``).
    ``supernode``: the command a site runs, ``flower-supernode`` or ``pflower-supernode``
    (each site with a fork server of its own, as on a real device: ``launch/site.py``).
    ``database``: the SuperLink's SQLite file in ``home``, as the loopback recipe
    (docs/deployment.md) and the compose file keep theirs (the benchmarks measure that);
    None: Flower's in-memory state,
    which serves the same runs for a third of the SuperLink's CPU (the tests).
    ``node_configs[site]``: more of the site's ``--node-config``, after its own keys (e.g.
    its privacy floor, ``"dp-min-noise-multiplier=1.0"``: ``client_app/site_floor.py``)."""

    def __init__(self, num_sites: int = 3, certs_dir: str | Path | None = None,
                 home: str | Path | None = None, namespaces: bool = False,
                 supernode_auth: bool = False, node_names: dict[int, str] | None = None,
                 client_ids: dict[int, str] | None = None,
                 start_sites: list[int] | None = None, site_threads: int | None = None,
                 poll_interval: float = 0.2, forkserver: ForkServer | None = None,
                 supernode: str = "flower-supernode", database: str | None = "state.db",
                 node_configs: dict[int, str] | None = None) -> None:
        # the SuperExecs a SuperNode starts look for new work (each message's ClientApp)
        # every second by default
        super().__init__(home, forkserver=forkserver, superexec_poll_seconds=poll_interval)
        if supernode_auth and not certs_dir:
            raise ValueError("SuperNode authentication needs TLS (certs_dir)")
        self.num_sites = num_sites
        self.certs_dir = Path(certs_dir) if certs_dir else None
        self.supernode_auth = supernode_auth
        self.node_names = {k: f"site-{k}" for k in range(num_sites)} | (node_names or {})
        self.client_ids = {k: f"site-{k}" for k in range(num_sites)} | (client_ids or {})
        self.start_sites = list(range(num_sites)) if start_sites is None else start_sites
        self.site_threads = (max(1, (os.cpu_count() or 1) // num_sites)
                             if site_threads is None else site_threads)
        self.database = database
        self.supernode = supernode
        self.node_configs = dict(node_configs or {})
        self.site_ports = [free_port() for _ in range(num_sites)]
        self.sites: dict[int, subprocess.Popen] = {}
        self.namespaces = namespaces
        self._tag = secrets.token_hex(2)  # names of this deployment's namespaces and links
        self._block = secrets.randbelow(256 - num_sites)  # its 198.18.<block + site>.0/24

    def namespace(self, site: int) -> str:
        return f"pfl{self._tag}s{site}"

    def _host_link(self, site: int) -> str:
        """The host end of the site's veth pair (deleting it deletes both ends)."""
        return f"pfl{self._tag}h{site}"

    def site_address(self, site: int) -> str:
        """Where the site's SuperNode runs: its own address, or loopback."""
        return f"198.18.{self._block + site}.2" if self.namespaces else "127.0.0.1"

    def _superlink_address(self, site: int) -> str:
        return f"198.18.{self._block + site}.1" if self.namespaces else "127.0.0.1"

    def _make_namespace(self, site: int) -> None:
        """A network namespace for the site, linked to the host by a veth pair."""
        name, host_end, site_end = (self.namespace(site), self._host_link(site),
                                    f"pfl{self._tag}n{site}")
        _ip("netns", "add", name)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", site_end)
        _ip("link", "set", site_end, "netns", name)
        _ip("addr", "add", f"{self._superlink_address(site)}/24", "dev", host_end)
        _ip("link", "set", host_end, "up")
        for args in (("addr", "add", f"{self.site_address(site)}/24", "dev", site_end),
                     ("link", "set", site_end, "up"), ("link", "set", "lo", "up")):
            _ip("netns", "exec", name, "ip", *args)

    def _remove_namespaces(self) -> None:
        for site in range(self.num_sites):
            for args in (("link", "del", self._host_link(site)),
                         ("netns", "del", self.namespace(site))):
                with contextlib.suppress(subprocess.CalledProcessError, OSError):
                    _ip(*args)

    def _spawn(self, command: list[str], log_name: str,
               env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.home / log_name, "ab")  # noqa: SIM115 (outlives this call)
        return subprocess.Popen(command, env={**self.env, **(env or {})}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

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
        if self.namespaces:
            try:
                for site in range(self.num_sites):
                    self._make_namespace(site)
            except (subprocess.CalledProcessError, OSError):
                self._remove_namespaces()
                raise
        self.process = self._spawn(
            ["flower-superlink", *security, "--host",
             "0.0.0.0" if self.namespaces else "127.0.0.1", "--port",
             str(self.http_port),
             *(["--database", str(self.home / self.database)] if self.database else []),
             "--disable-runtime-dependency-installation",
             *(["--enable-supernode-auth"] if self.supernode_auth else [])], "superlink.log")
        self._wait_healthy()
        for site in range(self.num_sites):
            if self.supernode_auth:
                self.register_site(site)
            if site in self.start_sites:
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

    def node_key(self, site: int) -> Path:
        return self.home / f"site-{site}-key"

    def register_site(self, site: int) -> None:
        """Make the site's key pair and register its public key under its node name
        (``flwr supernode register KEY.pub local --name NAME``)."""
        public = write_node_key(self.node_key(site))
        subprocess.run(["flwr", "supernode", "register", str(public), "local", "--name",
                        self.node_names[site]], env=self.env, check=True,
                       capture_output=True, text=True)

    def start_site(self, site: int) -> None:
        """Start (or restart) site ``site``'s SuperNode with its node config."""
        security = (["--root-certificates", str(self.certs_dir / "ca.crt")]
                    if self.certs_dir else ["--insecure"])
        if self.supernode_auth:
            security += ["--auth-supernode-private-key", str(self.node_key(site))]
        node_config = (f"partition-id={site} num-partitions={self.num_sites} "
                       f"client-id='{self.client_ids[site]}' "
                       f"state-dir='{self.state_dir(site)}' "
                       f"{self.node_configs.get(site, '')}").strip()
        prefix = ["ip", "netns", "exec", self.namespace(site)] if self.namespaces else []
        self.sites[site] = self._spawn(
            [*prefix, self.supernode, *security, "--superlink",
             f"{self._superlink_address(site)}:{self.http_port}",
             "--host", "127.0.0.1", "--port", str(self.site_ports[site]),
             "--node-config", node_config], f"site-{site}.log",
            {"OMP_NUM_THREADS": str(self.site_threads)} if self.site_threads else None)

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
        if self.namespaces:
            self._remove_namespaces()

    def run(self, app_dir: str | Path, run_config: dict[str, Any] | None = None, *,
            timeout: float = 900, echo: bool = False, **_: Any) -> FlowerRun:
        """``flwr run APP --stream`` through the deployment's SuperLink, the run config
        checked first (its sites are on this machine: ``launch.run_config``)."""
        check_run_config(run_config or {}, app_dir, self.num_sites)
        return self.flwr_run(app_dir, run_config, [], timeout=timeout, echo=echo)
