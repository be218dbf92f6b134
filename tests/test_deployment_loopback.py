"""Integration: a real Deployment Runtime on loopback (flower-superlink + 3 flower-supernode
processes, each with its own port, node config and state dir), insecure and with TLS."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from common.local_deployment import LocalDeployment
from tests.conftest import read_results

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"method": "fedper", "num-server-rounds": 2, "local-epochs": 1, "min-nodes": 3,
          "plot": False, "round-timeout": 120.0}


def _check(run, out: Path, tmp: Path, deployment: LocalDeployment) -> None:
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    for entry in results["rounds"]:
        assert entry["train"]["num_clients"] == 3
        assert sorted(entry["eval"]["per_client"]) == ["site-0", "site-1", "site-2"]
    for site in range(3):  # durable personal state, one file per client id
        assert (deployment.state_dir(site) / f"site-{site}.pt").exists()


def test_insecure_deployment_runs_a_personalized_method(tmp_path):
    with LocalDeployment(3, home=tmp_path / "home") as deployment:
        out = tmp_path / "out"
        run = deployment.run(ROOT, {**CONFIG, "output-dir": str(out)})
        _check(run, out, tmp_path, deployment)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_deployment_with_certificates_from_the_script(tmp_path):
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(certs)], check=True,
                   capture_output=True)
    with LocalDeployment(3, certs_dir=certs, home=tmp_path / "home") as deployment:
        out = tmp_path / "out"
        run = deployment.run(ROOT, {**CONFIG, "output-dir": str(out)})
        _check(run, out, tmp_path, deployment)
        assert "insecure" not in (deployment.home / "config.toml").read_text()
