"""The docker-compose deployment, run for real: images built (or reused), the stack brought up
by deploy/up.sh in a private folder, port and project, a real ``flwr run``, then attacked (a
SuperNode container SIGKILLed mid-run and restarted; a node with an unregistered key) and
always taken down again. Skipped, with the reason, only where Docker cannot be started at all
(not root and no engine running, or no apt-get to install one).

    python -m pytest -m compose        (cold: images built; cached: reused)
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.compose_stack import ComposeStack, DockerUnavailableError
from tests.conftest import read_results, run_in_background, wait_for

# one pytest worker runs both: each may install and start the Docker engine it then stops
pytestmark = [pytest.mark.integration, pytest.mark.compose, pytest.mark.xdist_group("docker")]
ROOT = Path(__file__).resolve().parents[1]
SITES = ["site-0", "site-1", "site-2"]
CONFIG = {"method": "fedper", "dataset": "digits", "num-server-rounds": 2, "local-epochs": 1,
          "min-nodes": 3, "plot": False, "round-timeout": 300.0}


def _stack(profile: str, base: Path) -> ComposeStack:
    try:
        return ComposeStack(profile, base).__enter__()
    except DockerUnavailableError as why:
        pytest.skip(f"Docker cannot be started here: {why}")


def _check_all_sites(results: dict, rounds: list[int]) -> None:
    assert [r["round"] for r in results["rounds"]] == rounds
    for entry in results["rounds"]:
        assert entry["train"]["num_clients"] == 3, entry
        assert sorted(entry["eval"]["per_client"]) == SITES, entry
        assert not entry.get("dropped"), entry["dropped"]


def test_insecure_profile_runs_survives_a_killed_site_and_resumes_after_down(tmp_path):
    stack = _stack("insecure", tmp_path)
    try:
        # the SuperLink's port is published on loopback only
        published = stack.docker("port", stack.container("superlink")).stdout.split()
        assert published == ["8000/tcp", "->", f"127.0.0.1:{stack.port}"], published

        first = stack.run(ROOT, {**CONFIG, "output-dir": "outputs/first"})
        assert first.ok, first.output[-3000:]
        out = stack.output("first")  # on the host: the outputs volume
        _check_all_sites(read_results(out), [1, 2])
        for i, site in enumerate(SITES):
            assert (stack.dir / "sites" / f"site-{i}" / "state" / f"{site}.pt").exists()

        # docker compose down loses nothing: results, checkpoint and client state stay on
        # the host, and the run resumes from them on a fresh stack
        stack.compose("down")
        assert (out / "checkpoint.npz").exists() and (out / "results.json").exists()
        stack.compose("up", "-d", "--no-build")
        stack.wait_ready()

        resumed = stack.output("resumed")
        runner, result = run_in_background(stack, {
            **CONFIG, "num-server-rounds": 5, "min-nodes": 2, "round-timeout": 240.0,
            "output-dir": "outputs/resumed", "resume-from": "outputs/first"})
        wait_for(lambda: not runner.is_alive() or "[round 3/5]" in stack.server_log(), 900,
                 poll=2)
        assert runner.is_alive(), result["run"].output[-3000:]
        stack.kill("supernode-2")                     # SIGKILL, mid-round
        wait_for(lambda: "(client site-2)" in stack.server_log(), 600, poll=2)
        restarted = time.time()
        stack.start("supernode-2")                    # new node id, empty context
        runner.join(1800)
        run = result["run"]
        assert run.ok, run.output[-3000:]
        assert "[resume] from round 2" in run.output
        rounds = {r["round"]: r for r in read_results(resumed)["rounds"]}
        assert sorted(rounds) == [1, 2, 3, 4, 5]
        dropped = [d for d in rounds[3].get("dropped", []) if d["client"] == "site-2"]
        assert dropped and all(d["reason"] for d in dropped), rounds[3]
        # the restarted site came back: evaluated on rejoining, then in the last round
        assert any("site-2" in r.get("rejoined", {}) for n, r in rounds.items() if n > 3)
        assert sorted(rounds[5]["eval"]["per_client"]) == SITES, rounds[5]
        # ... with its personal state read back from its volume
        assert "client site-2: restored personal state" in stack.logs(
            "superexec-clientapp-2", since=restarted)
    finally:
        stack.__exit__(None, None, None)  # deploy/up.sh stop fails if a container is left
    left = stack.docker("ps", "-aq", "--filter",
                        f"label=com.docker.compose.project={stack.project}", check=False)
    # no container of the project left (or no engine left: the stack stopped the one it started)
    assert left.returncode != 0 or not left.stdout.split(), left.stdout


def test_tls_profile_authenticates_supernodes(tmp_path):
    stack = _stack("tls", tmp_path)
    intruder = f"{stack.project}-intruder"
    try:
        certs = stack.dir / "certs"
        # a node whose key was never registered is refused
        key = tmp_path / "intruder"
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f",
                        str(key)], check=True)
        key.chmod(0o644)
        refused = stack.docker(
            "run", "--name", intruder, "--network", f"{stack.project}_link",
            "-v", f"{certs / 'ca.crt'}:/app/certs/ca.crt:ro", "-v", f"{key}:/app/key:ro",
            "flwr/supernode:1.42.0", "--root-certificates", "certs/ca.crt", "--superlink",
            "superlink:8000", "--auth-supernode-private-key", "key", "--max-retries", "2",
            "--node-config", "partition-id=0 num-partitions=3 client-id='intruder'",
            check=False)
        log = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "Failed to activate SuperNode" in log, log
        link = stack.docker("logs", stack.container("superlink-tls"))
        assert "[/v1/fleet/activate-node][ApiError:2004]" in link.stdout + link.stderr

        # two rounds: the second carries the first's evaluation over the authenticated links
        run = stack.run(ROOT, {**CONFIG, "output-dir": "outputs/tls"})
        assert run.ok, run.output[-3000:]
        _check_all_sites(read_results(stack.output("tls")), [1, 2])
        assert "insecure" not in (stack.home / "config.toml").read_text()
    finally:
        stack.docker("rm", "-f", intruder, check=False)
        stack.__exit__(None, None, None)
