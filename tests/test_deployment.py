"""docker-compose.yml checked without Docker: every command line parses with the installed
flwr CLIs, and node configs, volumes, ports and GPU reservations are consistent per site."""

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
FLWR = version("flwr")


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
        clientapp = services[name.replace("supernode-", "superexec-clientapp-")]
        assert _flag(clientapp["command"], "--runtime-api-address") == f"{name}:{ports[name]}"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in clientapp["volumes"]}
        # the ClientApp runs in the SuperExec: state and data are mounted there, per site
        assert config["state-dir"] in mounts and config["data-dir"] in mounts
        for path in (mounts[config["state-dir"]], mounts[config["data-dir"]]):
            assert path not in mounts_seen
            mounts_seen.add(path)
        devices = clientapp["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
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
