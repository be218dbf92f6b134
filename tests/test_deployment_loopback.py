"""Integration: a real Deployment Runtime on loopback (flower-superlink + 3 flower-supernode
processes, each with its own port, node config and state dir), insecure and with TLS."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
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


def _rounds_done(out: Path) -> int:
    path = out / "results.json"
    return len(read_results(out)["rounds"]) if path.exists() else 0


def _wait_for(predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(1)


def test_a_killed_supernode_is_recorded_and_restarts_with_its_state(tmp_path):
    out = tmp_path / "out"
    timeout = 60.0
    config = {**CONFIG, "method": "local", "num-server-rounds": 5, "min-nodes": 2,
              "round-timeout": timeout, "output-dir": str(out)}
    with LocalDeployment(3, home=tmp_path / "home") as deployment:
        result = {}
        runner = threading.Thread(target=lambda: result.update(run=deployment.run(ROOT, config)))
        runner.start()
        _wait_for(lambda: _rounds_done(out) >= 1, 900)
        deployment.kill_site(2)                       # SIGKILL, mid-run
        _wait_for(lambda: _rounds_done(out) >= 3, 900)
        deployment.start_site(2)                      # new node id, empty context.state
        runner.join(1200)
        run = result["run"]
        site_log = (deployment.home / "site-2.log").read_text()
    assert run.ok, run.output[-3000:]
    rounds = read_results(out)["rounds"]
    assert len(rounds) == 5
    missed = [r for r in rounds if any(d["client"] == "site-2" for d in r.get("dropped", []))]
    assert missed, "the dead site's missing replies are not recorded"
    for entry in missed:
        assert all(d["reason"] for d in entry["dropped"])
    # no exchange waits past round-timeout for a dead node: a round is a train and an
    # evaluate exchange, plus the ClientApp processes' own time on a loaded machine
    assert max(r["seconds"] for r in rounds) < 2 * timeout + 60
    # the restarted SuperNode read site-2's personal state back from its state-dir
    assert "site-2: restored personal state" in site_log
    assert "site-2" in rounds[-1].get("eval", {}).get("per_client", {}), rounds[-1]
