"""``pflower-supernode`` (launch/site.py): a site's SuperNode whose ClientApps start warm,
forked from a fork server of the site's own. On a real loopback deployment (a SuperLink and
two sites) running Flower's floor app (``bench/floor_app``): each message's ClientApp is a
child of the site's fork server; an app changed between two runs is the one that runs; a
ClientApp that kills itself leaves the site serving; where the fork server cannot start, the
site runs plain ``flower-supernode`` and says so in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from launch.deployment import LocalDeployment

ROOT = Path(__file__).resolve().parents[1]
FLOOR_APP = ROOT / "bench" / "floor_app"
SITES = 2


def _cmdline(pid: int) -> str:
    return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())


def _replies(deployment: LocalDeployment, app: Path, out: Path, **config) -> list[list[dict]]:
    run = deployment.flwr_run(app, {"num-server-rounds": 2, "min-nodes": SITES,
                                    "output-dir": str(out), **config}, [], timeout=300)
    assert run.ok, run.output[-3000:]
    return json.loads((out / "floor.json").read_text())["replies"]


@pytest.mark.integration
def test_a_warm_site_forks_each_clientapp_runs_the_app_it_was_given_and_outlives_a_crash(
        tmp_path):
    app = tmp_path / "floor"
    shutil.copytree(FLOOR_APP, app)
    with LocalDeployment(SITES, home=tmp_path / "home",
                         supernode="pflower-supernode", database=None) as deployment:
        first = _replies(deployment, app, tmp_path / "first")
        assert [len(r) for r in first] == [SITES, SITES]
        parents = {reply["parent"] for rounds in first for reply in rounds}
        # every message's ClientApp was forked by one of the two sites' fork servers
        assert len(parents) == SITES
        assert all("forkserver.py" in _cmdline(int(p)) for p in parents)
        # a new version of the app, installed for the next run, is the one that runs
        client = app / "floor_app" / "client.py"
        client.write_text(client.read_text().replace("VERSION = 1", "VERSION = 2"))
        second = _replies(deployment, app, tmp_path / "second")
        assert {reply["version"] for rounds in second for reply in rounds} == {2}
        assert {reply["parent"] for rounds in second for reply in rounds} == parents
        # every ClientApp of a run kills itself: no reply, and the sites go on serving
        crashed = _replies(deployment, app, tmp_path / "crashed", crash=True,
                           **{"num-server-rounds": 1, "round-timeout": 20.0})
        assert crashed == [[]]
        after = _replies(deployment, app, tmp_path / "after")
        assert [len(r) for r in after] == [SITES, SITES]
        assert {reply["parent"] for rounds in after for reply in rounds} == parents
    # the fork servers stop with their SuperNodes
    assert not [p for p in parents if Path(f"/proc/{int(p)}").exists()
                and "forkserver.py" in _cmdline(int(p))]


@pytest.mark.parametrize(("env", "reason"), [
    ({"PFLOWER_WARM_CLIENTAPPS": "0"}, "PFLOWER_WARM_CLIENTAPPS=0"),
    # a site whose PyTorch cannot be imported: the fork server fails to start
    ({"PYTHONPATH": "{broken}"}, "the fork server did not start"),
])
def test_where_the_fork_server_cannot_run_the_site_runs_plain_flower_supernode(
        tmp_path, env, reason):
    broken = tmp_path / "broken"
    (broken / "torch").mkdir(parents=True)
    (broken / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    env = {k: v.format(broken=broken) for k, v in env.items()}
    done = subprocess.run([str(Path(sys.executable).parent / "pflower-supernode"), "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert done.returncode == 0
    said = [line for line in done.stderr.splitlines() if line.startswith("pflower-supernode:")]
    assert len(said) == 1 and reason in said[0] and "plain flower-supernode" in said[0]
    assert "usage: flower-supernode" in done.stdout + done.stderr
