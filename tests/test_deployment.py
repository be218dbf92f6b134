"""docker-compose.yml (and docker-compose.gpu.yml) checked without Docker: every command line
parses with the installed flwr CLIs; node configs, volumes, ports and GPUs are consistent per
site; the insecure profile publishes the SuperLink on loopback only; no site mounts a private
key of the CA or the SuperLink (nor another site's files); the tls profile uses every
protection Flower offers for the processes that run apps; the ServerApp's outputs live on a
host volume. tests/test_compose.py runs the stack for real."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from flwr.common.config import parse_config_args
from flwr.supercore.cli.flower_superexec import _parse_args as superexec_parser
from flwr.superlink.cli.flower_superlink import _parse_args_run_superlink
from flwr.supernode.cli.flower_supernode import _parse_args_run_supernode

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
GPUS = yaml.safe_load((ROOT / "docker-compose.gpu.yml").read_text())["services"]
FLWR = version("flwr")
HOST_DIR = "./deploy"  # PFLOWER_DIR's default


def cli_of(service: dict) -> str:
    if "build" in service:
        assert service["build"]["dockerfile"] == "deploy/superexec.Dockerfile"
        return "superexec"
    image = service["image"]
    assert image == f"flwr/{image.split('/')[1].split(':')[0]}:{FLWR}", image
    return image.split("/")[1].split(":")[0]


PARSERS = {"superlink": _parse_args_run_superlink, "supernode": _parse_args_run_supernode,
           "superexec": superexec_parser}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_command_line_parses_with_the_pinned_flwr(name):
    service = SERVICES[name]
    command = [str(arg) for arg in service["command"]]
    args = PARSERS[cli_of(service)]().parse_args(command)  # unknown flags: SystemExit
    assert args is not None


def test_superexec_image_is_pinned_to_the_project_flwr():
    dockerfile = (ROOT / "deploy" / "superexec.Dockerfile").read_text()
    assert re.search(rf"^FROM flwr/superexec:{re.escape(FLWR)}$", dockerfile, re.M)
    assert f'"flwr[simulation]=={FLWR}"' in (ROOT / "pyproject.toml").read_text()


def _flag(command: list, flag: str) -> str:
    return str(command[command.index(flag) + 1])


@pytest.mark.parametrize("profile", ["insecure", "tls"])
def test_sites_are_consistent(profile):
    services = {n: s for n, s in SERVICES.items() if profile in s.get("profiles", [])}
    supernodes = {n: s for n, s in services.items() if n.startswith("supernode-")}
    configs = {n: parse_config_args([_flag(s["command"], "--node-config")])
               for n, s in supernodes.items()}
    sites = len(supernodes)
    assert sites >= 3
    assert sorted(c["partition-id"] for c in configs.values()) == list(range(sites))
    assert {c["num-partitions"] for c in configs.values()} == {sites}
    assert len({c["client-id"] for c in configs.values()}) == sites
    ports = {n: int(_flag(s["command"], "--port")) for n, s in supernodes.items()}
    assert len(set(ports.values())) == sites
    mounts_seen = set()
    for name, config in configs.items():
        assert {"state-dir", "data-dir"} <= set(config)
        clientapp_name = name.replace("supernode-", "superexec-clientapp-")
        clientapp = services[clientapp_name]
        site = name.removeprefix("supernode-").removesuffix("-tls")
        address = _flag(clientapp["command"], "--runtime-api-address")
        assert address == f"supernode-{site}:{ports[name]}"
        mounts = _mounts(clientapp)
        # the ClientApp runs in the SuperExec: state and data are mounted there, per site
        assert config["state-dir"] in mounts and config["data-dir"] in mounts
        for path in (mounts[config["state-dir"]], mounts[config["data-dir"]]):
            assert path not in mounts_seen
            mounts_seen.add(path)
    links = [n for n in services if n.startswith("superlink")]
    assert len(links) == 1
    link = services[links[0]]
    assert "--database" in link["command"]
    tls = "--insecure" not in link["command"]
    assert tls == (profile == "tls")
    if tls:
        for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
            assert flag in link["command"]
        for name in supernodes:
            assert "--root-certificates" in services[name]["command"]


def _resolve(text: str) -> str:
    """Compose's ``${VAR:-default}`` with every variable unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


def _mounts(service: dict) -> dict[str, str]:
    """Container path -> host path of the service's volumes, defaults resolved."""
    volumes = [_resolve(v).split(":") for v in service.get("volumes", [])]
    return {target: source for source, target, *_ in volumes}


def _profile(profile: str) -> dict[str, dict]:
    return {n: s for n, s in SERVICES.items() if profile in s.get("profiles", [])}


def test_insecure_profile_publishes_the_superlink_on_loopback_only():
    for name, service in _profile("insecure").items():
        for port in service.get("ports", []):
            assert _resolve(str(port)).startswith("127.0.0.1:"), (name, port)
    assert _profile("insecure")["superlink"]["ports"] == ["127.0.0.1:${PFLOWER_PORT:-8000}:8000"]
    # tls: the operator chooses where (PFLOWER_PUBLISH), loopback unless told otherwise
    (port,) = SERVICES["superlink-tls"]["ports"]
    assert _resolve(port).startswith("127.0.0.1:")
    published = [n for n, s in SERVICES.items() if s.get("ports")]
    assert sorted(published) == ["superlink", "superlink-tls"]


@pytest.mark.parametrize("profile", ["insecure", "tls"])
def test_no_site_mounts_a_private_key_of_the_ca_or_the_superlink(profile):
    services = _profile(profile)
    sites = {n for n in services if n.startswith(("supernode-", "superexec-clientapp-"))}
    assert len(sites) == 6
    forbidden = {f"{HOST_DIR}/certs/ca.key", f"{HOST_DIR}/certs/server.key",
                 f"{HOST_DIR}/secrets/serverapp"}
    for name, service in services.items():
        for source in _mounts(service).values():
            # files one by one: never a whole certs/, keys/ or secrets/ folder
            assert source not in {f"{HOST_DIR}/{d}" for d in ("certs", "keys", "secrets")}
            assert not source.endswith("ca.key"), (name, source)  # ca.key is never mounted
            if name in sites:
                assert source not in forbidden, (name, source)
                site = re.search(r"-(\d+)", name).group(1)
                others = re.findall(r"site-(\d+)", source)
                assert all(other == site for other in others), (name, source)
    for name in sites:  # a site's ClientApp SuperExec holds no private key at all
        if name.startswith("superexec-"):
            assert not [s for s in _mounts(services[name]).values()
                        if s.endswith((".key", "/keys"))], name


def test_each_site_gets_its_own_gpu():
    for profile in ("insecure", "tls"):
        ids = []
        for name in _profile(profile):
            if name.startswith("superexec-clientapp-"):
                devices = GPUS[name]["deploy"]["resources"]["reservations"]["devices"]
                assert len(devices) == 1 and "count" not in devices[0], devices
                assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
                ids += devices[0]["device_ids"]
        assert len(ids) == 3 and len(set(ids)) == 3, ids
    assert set(GPUS) <= set(SERVICES)


@pytest.mark.parametrize("name", ["superexec-serverapp", "superexec-serverapp-tls"])
def test_serverapp_results_and_checkpoints_live_on_a_host_volume(name):
    # the ServerApp runs in /app (the images' working directory): output-dir
    # `outputs/<run>` (the default) lands in the host's PFLOWER_DIR/outputs
    assert _mounts(SERVICES[name])["/app/outputs"] == f"{HOST_DIR}/outputs"
    assert f"{HOST_DIR}/outputs:/app/outputs:rw" in [_resolve(v) for v in SERVICES[name]["volumes"]]


def test_tls_profile_uses_every_protection_for_the_processes_that_run_apps():
    services = _profile("tls")
    for name, service in services.items():
        command = [str(a) for a in service["command"]]
        assert "--insecure" not in command, name
        assert "--allow-runtime-dependency-installation" not in command, name
        assert "--superexec-auth-secret-file" in command, name  # Runtime API: only its SuperExec
    link = [str(a) for a in services["superlink-tls"]["command"]]
    for flag in ("--enable-supernode-auth", "--disable-runtime-dependency-installation",
                 "--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
        assert flag in link
    for name, service in services.items():
        command = [str(a) for a in service["command"]]
        if name.startswith("supernode-"):
            site = name.split("-")[1]
            assert _flag(command, "--auth-supernode-private-key") == f"keys/site-{site}"
            for flag in ("--root-certificates", "--ssl-certfile", "--ssl-keyfile",
                         "--ssl-ca-certfile"):  # its Runtime API over TLS too
                assert flag in command, (name, flag)
            config = parse_config_args([_flag(command, "--node-config")])
            assert config["client-id"] == f"site-{site}"
        elif name.startswith("superexec-"):
            assert "--root-certificates" in command, name
    # the SuperExec secret of a site is its own, the ServerApp's is the SuperLink's
    secrets = {n: _flag([str(a) for a in s["command"]], "--superexec-auth-secret-file")
               for n, s in services.items()}
    assert secrets["superlink-tls"] == secrets["superexec-serverapp-tls"] == "secrets/serverapp"
    for site in range(3):
        assert (secrets[f"supernode-{site}-tls"] == secrets[f"superexec-clientapp-{site}-tls"]
                == f"secrets/site-{site}")


def test_a_sites_clientapp_reaches_only_its_own_supernode():
    networks = COMPOSE["networks"]
    for name, service in SERVICES.items():
        if name.startswith("superexec-clientapp-"):
            site = name.split("-")[2]
            assert list(service["networks"]) == [f"site-{site}"], name
            assert networks[f"site-{site}"] == {"internal": True}
