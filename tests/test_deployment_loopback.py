"""Integration: a real Deployment Runtime (flower-superlink + 2 to 4 flower-supernode
processes, each with its own port, node config and state dir; in their own network namespaces
where the machine allows, else on loopback), insecure and with TLS plus SuperNode
authentication, a killed and restarted SuperNode, a node claiming another's id, a stopped and
resumed run, and the loopback recipe of docs/deployment.md."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from launch.deployment import LocalDeployment, namespaces_available
from launch.processes import free_port
from server_app.rounds import load_checkpoint
from tests.conftest import copy_app, read_results, run_in_background, wait_for

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"method": "fedper", "num-server-rounds": 2, "local-epochs": 1, "min-nodes": 3,
          "plot": False, "round-timeout": 120.0}
# The deployments below keep the SuperLink's state in memory (``database=None``): none
# restarts its SuperLink, and SQLite costs it three times the CPU. The loopback recipe, run
# as written at the end, keeps its database file, as compose does.



def port_block(count: int) -> int:
    """A port whose ``count - 1`` successors are free too: the recipe gives its sites the
    ports after its SuperLink's, and another worker's server may hold one of them."""
    for _ in range(100):
        port = free_port()
        if all(_bindable(port + i) for i in range(1, count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports found")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

def _check(run, out: Path, tmp: Path, deployment: LocalDeployment) -> None:
    """Every site that speaks for its own client id trained and evaluated every round."""
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    genuine = [k for k, client in deployment.client_ids.items() if client == f"site-{k}"]
    for entry in results["rounds"]:
        assert entry["train"]["num_clients"] == len(genuine)
        assert sorted(entry["eval"]["per_client"]) == [f"site-{k}" for k in genuine]
    for site in genuine:  # durable personal state, one file per client id
        assert (deployment.state_dir(site) / f"site-{site}.pt").exists()


NAMESPACES = namespaces_available()


def _net_namespace(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def _rounds_done(out: Path) -> int:
    path = out / "results.json"
    return len(read_results(out)["rounds"]) if path.exists() else 0


def test_a_killed_supernode_is_recorded_and_restarts_with_its_state(tmp_path, forkserver):
    out = tmp_path / "out"
    timeout = 60.0
    # the two-exchange protocol: "round k written" then means site-2's round-k state was
    # evaluated, which the assertions below compare with its state after the restart
    config = {**CONFIG, "method": "local", "num-server-rounds": 5, "min-nodes": 2,
              "round-timeout": timeout, "output-dir": str(out), "fused-evaluation": False}
    with LocalDeployment(3, home=tmp_path / "home", forkserver=forkserver,
                         database=None) as deployment:
        runner, result = run_in_background(deployment, config)
        wait_for(lambda: _rounds_done(out) >= 1, 900, poll=0.2)
        deployment.kill_site(2)                       # SIGKILL, mid-run
        # the round of the newest personal state site-2 had on disk when it died
        killed_round = max(torch.load(path, weights_only=True)["round"] for path in
                           deployment.state_dir(2).glob("site-2*.pt"))
        wait_for(lambda: _rounds_done(out) >= killed_round + 2, 900)
        deployment.start_site(2)                      # new node id, empty context.state
        runner.join(1200)
        run = result["run"]
        site_log = (deployment.home / "site-2.log").read_text()
    assert run.ok, run.output[-3000:]
    rounds = {r["round"]: r for r in read_results(out)["rounds"]}
    assert sorted(rounds) == [1, 2, 3, 4, 5]
    missed = [r for r in rounds.values()
              if any(d["client"] == "site-2" for d in r.get("dropped", []))]
    assert missed, "the dead site's missing replies are not recorded"
    for entry in missed:
        assert all(d["reason"] for d in entry["dropped"])
    # no exchange waits past round-timeout for a dead node: a round is a train and an
    # evaluate exchange, plus the ClientApp processes' own time on a loaded machine
    assert max(r["seconds"] for r in rounds.values()) < 2 * timeout + 60
    # the restarted SuperNode read site-2's personal state back from its state-dir ...
    assert "site-2: restored personal state" in site_log
    # ... and its personalized accuracy right after the restart (evaluated before it trains
    # again) equals the last one before the kill (``local``: nothing shared changes it)
    before = rounds[killed_round]["eval"]["per_client"].get("site-2")
    assert before is not None, f"site-2 died after saving round {killed_round}, unevaluated"
    rejoined = [r["rejoined"]["site-2"] for r in rounds.values() if "rejoined" in r]
    assert rejoined == [before]
    assert "site-2" in rounds[5].get("eval", {}).get("per_client", {}), rounds[5]


def test_an_insecure_deployment_runs_and_a_stopped_run_resumes_to_the_same_results(tmp_path,
                                                                                   forkserver):
    """An insecure deployment of two sites, each SuperNode in its own network namespace with
    its own address where the machine allows it (``ip netns``), else on loopback, runs a
    personalized method. Then ``flwr stop`` the ServerApp after round 1 of 3, resume from its
    checkpoint: the results equal the uninterrupted run's (personal state comes back from
    state-dir). Ditto and FedALA then run on the same sites."""
    base = {**CONFIG, "num-server-rounds": 3, "min-nodes": 2}
    full, stopped, resumed = tmp_path / "full", tmp_path / "stopped", tmp_path / "resumed"
    with LocalDeployment(2, home=tmp_path / "home", namespaces=NAMESPACES,
                         forkserver=forkserver, database=None) as deployment:
        uninterrupted = deployment.run(ROOT, {**base, "output-dir": str(full)})
        _check(uninterrupted, full, tmp_path, deployment)
        if NAMESPACES:  # checked once the SuperNodes have served (``ip netns exec`` has
            # switched namespace by then; right after spawning it may not have yet)
            site_namespaces = {_net_namespace(p.pid) for p in deployment.sites.values()}
            assert len(site_namespaces) == 2 and _net_namespace("self") not in site_namespaces
        runner, result = run_in_background(deployment, {**base, "output-dir": str(stopped)})
        wait_for(lambda: _rounds_done(stopped) >= 1, 900, poll=0.2)
        running = [r["run-id"] for r in deployment.runs() if r["status"] == "running"]
        assert len(running) == 1, deployment.runs()
        deployment.stop(running[0])
        runner.join(600)
        assert result["run"].status != "finished:completed", result["run"].status
        done = load_checkpoint(stopped)["round"]  # the last round it completed
        assert 1 <= done < 3
        again = deployment.run(ROOT, {**base, "output-dir": str(resumed),
                                      "resume-from": str(stopped)})
        # the methods that change the model where it arrives (Method.adapt), on the same sites
        for method in ("ditto", "fedala"):
            out = tmp_path / method
            _check(deployment.run(ROOT, {**CONFIG, "method": method, "min-nodes": 2,
                                         "local-epochs": 2, "output-dir": str(out)}),
                   out, tmp_path, deployment)
    assert again.ok, again.output[-3000:]
    assert f"[resume] from round {done}" in again.output
    expected, got = read_results(full), read_results(resumed)
    assert [r["round"] for r in got["rounds"]] == [1, 2, 3]
    for a, b in zip(expected["rounds"], got["rounds"], strict=True):
        assert a["eval"]["per_client"] == b["eval"]["per_client"]
        assert a["train"]["loss"] == b["train"]["loss"]
    for key in ("accuracy_weighted", "accuracy_mean", "accuracy_min", "bytes_up_total"):
        assert expected["final"][key] == got["final"][key]


def _impostor_checks(run, out: Path) -> list[dict]:
    """Site 3 claims client id site-0: every claim is dropped, it never gets work, and the
    genuine site-0 keeps its node, its downlink and its accuracy history."""
    assert run.ok, run.output[-3000:]
    results = read_results(out)
    claims = [d for r in results["rounds"] for d in r.get("dropped", [])
              if d["reason"] and "site-0" in d["reason"]]
    assert claims, [r.get("dropped") for r in results["rounds"]]
    assert {d["stage"] for d in claims} == {"identify"}  # refused nodes get no train/evaluate
    impostor = {d["node"] for d in claims}
    assert len(impostor) == 1
    owners = results["server_state"]["node_to_client"]
    assert sorted(owners.values()) == ["site-0", "site-1", "site-2"]
    assert not impostor & {int(n) for n in owners}
    for entry in results["rounds"]:
        assert entry["train"]["num_clients"] == 3
        assert sorted(entry["eval"]["per_client"]) == ["site-0", "site-1", "site-2"]
    return claims


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_with_node_authentication_a_node_cannot_claim_another_sites_id(tmp_path,
                                                                          forkserver):
    """TLS with the certificates deploy/make-certs.sh makes, and SuperNode authentication:
    each site registered under its name; site 3 (registered as site-3) says it is site-0.
    The three genuine sites run a personalized method to the end."""
    certs = tmp_path / "certs"
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(certs)], check=True,
                   capture_output=True)
    with LocalDeployment(4, certs_dir=certs, home=tmp_path / "home", supernode_auth=True,
                         client_ids={3: "site-0"}, forkserver=forkserver,
                         database=None) as deployment:
        out = tmp_path / "out"
        run = deployment.run(ROOT, {**CONFIG, "min-nodes": 4, "output-dir": str(out),
                                    "identity.require-registered": True})
        _check(run, out, tmp_path, deployment)
        assert "insecure" not in (deployment.home / "config.toml").read_text()
    claims = _impostor_checks(run, out)
    assert all("registered as site-3 may not speak for client id site-0" in d["reason"]
               for d in claims)


def test_without_authentication_a_second_live_node_cannot_take_an_id(tmp_path, forkserver):
    """No authentication (identities are self-declared): once site-0 is known, a second live
    node claiming site-0 is refused instead of evicting it."""
    out = tmp_path / "out"
    with LocalDeployment(4, home=tmp_path / "home", client_ids={3: "site-0"},
                         start_sites=[0, 1, 2], forkserver=forkserver,
                         database=None) as deployment:
        runner, result = run_in_background(deployment, {**CONFIG, "num-server-rounds": 3,
                                                     "output-dir": str(out)})
        wait_for(lambda: _rounds_done(out) >= 1, 900, poll=0.2)
        deployment.start_site(3)
        runner.join(1200)
    claims = _impostor_checks(result["run"], out)
    assert all("client id site-0 is held by live node" in d["reason"] for d in claims)


def loopback_recipe() -> str:
    """The bash block under ``<!-- loopback-recipe -->`` in docs/deployment.md ("On one
    machine, without Docker"), as it stands there."""
    text = (ROOT / "docs" / "deployment.md").read_text().split("<!-- loopback-recipe -->", 1)[1]
    return text.split("```bash\n", 1)[1].split("\n```", 1)[0]


def test_the_loopback_recipe_runs_as_written(tmp_path, forkserver):
    """The deployment page's recipe without Docker, pasted into bash in a copy of the app, with
    ``SITES=2`` (its default is 3; two show the same): every site trains and evaluates every
    round, results land where it says, and its last line, ``kill $PIDS``, leaves nothing of
    the deployment behind within 10 s: no process (the SuperLink, the SuperNodes, the
    SuperExecs they started, the sites' fork servers and what they forked) and none of the
    fork servers' folders. The recipe's commands run as written: its sites are
    ``pflower-supernode``s, each forking its SuperExec and ClientApps from a fork server of
    its own; the ServerApp is forked warm from the session's (its shims first on PATH). Its
    status line is read uncut (JSON). The deployment gets a temporary folder of its own
    (``TMPDIR``), where its fork servers make their folders."""
    app_dir = copy_app(tmp_path / "app")
    home = app_dir / ".flwr" / "loopback"
    tmpdir = Path(tempfile.mkdtemp(prefix="loopback-tmp-", dir="/tmp"))  # a short path
    warm = forkserver.env()
    log = tmp_path / "recipe.log"
    try:
        with log.open("w") as out:
            process = subprocess.Popen(
                ["bash", "-c", loopback_recipe()], cwd=app_dir, text=True, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **warm, "PORT": str(port_block(3)), "SITES": "2",
                     "PATH": os.pathsep.join([warm["PATH"], str(Path(sys.executable).parent),
                                              os.environ["PATH"]]),
                     "FLWR_DISABLE_UPDATE_CHECK": "1", "TMPDIR": str(tmpdir)})
        try:
            # the fork servers' folders, seen while the deployment runs
            folders, deadline = set(), time.monotonic() + 600
            while process.poll() is None and time.monotonic() < deadline:
                folders |= set(tmpdir.glob("pflower-fork-*"))
                time.sleep(0.5)
            process.wait(max(1.0, deadline - time.monotonic()))
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        # `kill $PIDS` was the recipe's last command: from its end, 10 s for everything
        # the deployment started to be gone (the sites' SuperExecs would otherwise outlive
        # their SuperNodes by up to 20 s, and the fork servers' folders stay); a site's fork
        # server was still there after 5 s once in CI, with three test workers on 2 cores
        left = _left_behind(home, app_dir, tmpdir, within=10.0)
        output = log.read_text()
        assert process.returncode == 0, output[-3000:]
        assert "[final] wrote to outputs/loopback: results.json, results.png, checkpoint.npz\n" \
            in output
        assert '"status": "finished:completed"' in output
        results = read_results(app_dir / "outputs" / "loopback")
        assert results["status"] == "completed" and results["method"] == "fedper"
        assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
        for entry in results["rounds"]:
            assert entry["train"]["num_clients"] == 2 and entry["eval"]["num_clients"] == 2
        assert all((home / f"site-{i}" / f"{i}.pt").exists() for i in range(2))
        # each site started warm, its fork server's folder in the deployment's TMPDIR
        assert len(folders) == 2, folders
        for i in range(2):
            assert "ClientApps start cold" not in (home / f"site-{i}.log").read_text()
        assert not left, left
    finally:
        for pid in _deployment_processes(home, app_dir, tmpdir):  # a failed test's only
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _left_behind(home: Path, app_dir: Path, tmpdir: Path, within: float) -> list[str]:
    """What is left of a deployment after ``within`` seconds (polled; empty as soon as
    nothing is): its processes, and the fork servers' folders in its ``tmpdir``."""
    deadline = time.monotonic() + within
    while True:
        left = [*_deployment_processes(home, app_dir, tmpdir).values(),
                *map(str, tmpdir.glob("pflower-fork-*"))]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)


def _deployment_processes(home: Path, app_dir: Path, tmpdir: Path) -> dict[int, str]:
    """Live processes of the deployment in ``home`` (never another test's): started with
    its ``FLWR_HOME`` or ``TMPDIR`` (the recipe's processes and all they start, forked ones
    included), naming either on their command line, or working in ``app_dir`` (the
    ServerApp, forked from the session's fork server). Their command lines, by pid."""
    marks = [f"FLWR_HOME={home}".encode(), f"TMPDIR={tmpdir}".encode()]
    found = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (proc / "stat").read_text().rsplit(") ", 1)[1].startswith("Z"):
                continue  # ended, not yet reaped
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if (any(mark in environ for mark in marks) or cwd == str(app_dir)
                or str(home) in cmdline or str(tmpdir) in cmdline):
            found[int(proc.name)] = f"{proc.name}: {cmdline}"
    return found
