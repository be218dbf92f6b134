"""A site's own privacy floor (client_app/site_floor.py, docs/privacy.md "A site's own floor"):
the node-config keys ``dp-require-mode`` and ``dp-min-noise-multiplier``, checked values, which
runs they refuse and in what line; every handler of the ClientApp refusing before it touches
the site's data; the server recording the refusal per node and stopping at the preflight when
every site refuses. Then one real deployment of two sites (one with a floor): a run below the
floor trains without the floored site, whose refusal is in results.json and the server's log
in one line; a run at the floor trains both; a run without DP, below both sites' floors,
stops before round 1 with that line."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

import client_app.runtime
from client_app.app import evaluate_personalized, query, train
from client_app.site_floor import SiteFloor, check_site_floor, site_floor
from common.config import ConfigError
from common.protocol import (
    ACTION,
    ARRAYS,
    CONFIG,
    IDENTIFY,
    SERVER_ROUND,
    ReplyError,
    parse_reply,
    shared_failure,
)
from launch.deployment import LocalDeployment
from strategies.engine.exchange import Exchange
from strategies.engine.replies import RunFailedError, stop_if_every_reply_failed
from strategies.registry import initial_state, load_settings
from tests.conftest import app_config, make_client, read_results

ROOT = Path(__file__).resolve().parents[1]
FLOOR = {"dp-min-noise-multiplier": 1.0}


# ---------------------------------------------------------------------- the node config
def test_no_floor_keys_no_requirement():
    assert site_floor({"partition-id": 0, "num-partitions": 2}) == SiteFloor("", 0.0)
    assert site_floor({"dp-require-mode": "local", "dp-min-noise-multiplier": 2}) == \
        SiteFloor("local", 2.0)


@pytest.mark.parametrize(("node", "message"), [
    ({"dp-min-noise-multiplier": "1.0"}, "'1.0' is not a number (a string: write the number "
                                         "without quotes)"),
    ({"dp-min-noise-multiplier": True}, "True is not a number"),
    ({"dp-min-noise-multiplier": -1}, "-1 is out of range; allowed: a number >= 0"),
    ({"dp-min-noise-multiplier": math.nan}, "nan is out of range"),
    ({"dp-min-noise-multiplier": math.inf}, "inf is out of range"),
    ({"dp-require-mode": "locl"}, "'locl' is not a mode; allowed: '' (no requirement), "
                                  "'central' (central or local DP), 'local' (local DP only)"
                                  "; did you mean 'local'?"),
    ({"dp-require-mode": 1}, "1 is not a mode"),
    # a floor the site meant to set, under a name that is none: never silently no floor
    ({"dp.min-noise-multiplier": 1.0}, "unknown key 'dp.min-noise-multiplier'; a site's "
                                       "privacy keys are dp-require-mode, "
                                       "dp-min-noise-multiplier, dp-exact-evaluation; did you "
                                       "mean 'dp-min-noise-multiplier'?"),
    ({"dp-mode": "local"}, "unknown key 'dp-mode'"),
])
def test_a_floor_that_does_not_parse_is_refused_in_one_line(node, message):
    with pytest.raises(ConfigError) as error:
        site_floor(node)
    assert str(error.value).startswith("node config: ")
    assert message in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------------- what is refused
@pytest.mark.parametrize(("floor", "mode", "noise", "shortfall"), [
    (SiteFloor(), "", 1.0, None),
    (SiteFloor("central"), "central", 0.1, None),
    (SiteFloor("central"), "local", 0.1, None),
    (SiteFloor("central"), "", 1.0, "dp-require-mode=central but the run has dp.mode='' (no DP)"),
    (SiteFloor("local"), "local", 0.1, None),
    (SiteFloor("local"), "central", 5.0, "dp-require-mode=local but the run has dp.mode=central"),
    (SiteFloor("local"), "", 5.0, "dp-require-mode=local but the run has dp.mode='' (no DP)"),
    (SiteFloor("", 1.0), "local", 1.0, None),
    (SiteFloor("", 1.0), "central", 2.0, None),
    (SiteFloor("", 1.0), "local", 0.5,
     "dp-min-noise-multiplier=1.0 but the run has dp.noise-multiplier=0.5"),
    (SiteFloor("", 1.0), "central", 0.5,
     "dp-min-noise-multiplier=1.0 but the run has dp.noise-multiplier=0.5"),
    # a noise floor requires DP: a run without it is refused, whatever its multiplier says
    (SiteFloor("", 1.0), "", 5.0, "dp-min-noise-multiplier=1.0 but the run has dp.mode='' "
                                  "(no DP)"),
    (SiteFloor("local", 1.0), "central", 0.5,
     "dp-require-mode=local, dp-min-noise-multiplier=1.0 but the run has dp.mode=central, "
     "dp.noise-multiplier=0.5"),
    (SiteFloor("local", 1.0), "local", 0.5,
     "dp-min-noise-multiplier=1.0 but the run has dp.noise-multiplier=0.5"),
    (SiteFloor("local", 1.0), "", 1.0,
     "dp-require-mode=local, dp-min-noise-multiplier=1.0 but the run has dp.mode='' (no DP)"),
])
def test_the_runs_below_a_floor_and_why(floor, mode, noise, shortfall):
    assert floor.shortfall(mode, noise) == shortfall


def test_the_refusal_names_the_floor_the_runs_setting_and_the_client():
    settings = load_settings(app_config(**{"dp.mode": "local", "dp.noise-multiplier": 0.5}))
    check_site_floor({}, settings, "site-0")  # no floor: nothing refused
    check_site_floor({"dp-min-noise-multiplier": 0.5}, settings, "site-0")  # at it: accepted
    with pytest.raises(ConfigError) as error:
        check_site_floor(FLOOR, settings, "site-0")
    assert str(error.value) == (
        "site floor: dp-min-noise-multiplier=1.0 but the run has dp.noise-multiplier=0.5; "
        "this site (client site-0) does not train below its floor")


# ---------------------------------------------------------------------- the ClientApp
def _message(message_type: str, content: RecordDict) -> Message:
    return Message(content, dst_node_id=100, message_type=message_type)


@pytest.mark.usefixtures("server_task")
def test_every_handler_refuses_below_the_floor_before_it_reads_the_sites_data(monkeypatch):
    """identify (the preflight), train, evaluate and a method's queries: one error reply, its
    reason one line; nothing of the site's data is loaded (a load would fail the test)."""
    def no_data(*_args, **_kwargs):
        raise AssertionError("the site's data was read")

    monkeypatch.setattr(client_app.runtime, "load_client_data", no_data)
    client_app.runtime._client_data.cache_clear()
    config = app_config(method="fedfac", **{"dp.mode": "local", "dp.noise-multiplier": 0.5})
    context = Context(run_id=1, node_id=100, node_config={
        "partition-id": 0, "num-partitions": 4, "client-id": "hospital-a", **FLOOR},
        state=RecordDict(), run_config=config)
    arrays = initial_state(load_settings(config)).arrays
    round_config = ConfigRecord({SERVER_ROUND: 1})
    replies = [
        query(_message(MessageType.QUERY, RecordDict({CONFIG: ConfigRecord(
            {ACTION: IDENTIFY})})), context),
        train(_message(MessageType.TRAIN, RecordDict({ARRAYS: arrays, CONFIG: round_config})),
              context),
        evaluate_personalized(_message(MessageType.EVALUATE, RecordDict(
            {ARRAYS: arrays, CONFIG: round_config})), context),
        query(_message(MessageType.QUERY, RecordDict({CONFIG: ConfigRecord(
            {ACTION: "fedfac.personal"})})), context),
    ]
    expected = ("ConfigError: site floor: dp-min-noise-multiplier=1.0 but the run has "
                "dp.noise-multiplier=0.5; this site (client hospital-a) does not train below "
                "its floor")
    assert [reply.error.reason for reply in replies] == [expected] * 4
    # at the floor the same site serves: its identify reply says who it is
    monkeypatch.undo()
    at_floor = Context(run_id=1, node_id=100, node_config=context.node_config,
                       state=RecordDict(), run_config={**config, "dp.noise-multiplier": 1.0})
    reply = query(_message(MessageType.QUERY, RecordDict({CONFIG: ConfigRecord(
        {ACTION: IDENTIFY})})), at_floor)
    assert not reply.has_error(), reply.error


def test_a_bad_floor_fails_every_message_in_one_line():
    with pytest.raises(ConfigError, match="node config: dp-require-mode: 'centrl' is not a mode"):
        make_client(0, app_config(**{"dp.mode": "central"}), **{"dp-require-mode": "centrl"})
    # a site without a floor, or with one the run meets, is served as before
    make_client(0, app_config(**{"dp.mode": "central"}), **{"dp-require-mode": "central"})


# ---------------------------------------------------------------------- the server's records
def _refusal(client_id: str) -> Message:
    """The error reply a floored site sends (one line), as the server receives it."""
    from client_app.app import error_reply

    config = app_config(**{"dp.mode": "central", "dp.noise-multiplier": 0.5})

    @error_reply
    def refuse(msg: Message, context: Context) -> Message:
        check_site_floor({"dp-require-mode": "local", **FLOOR}, load_settings(config),
                         client_id)
        raise AssertionError("not refused")

    return refuse(_message(MessageType.QUERY, RecordDict()), Context(
        run_id=1, node_id=100, node_config={}, state=RecordDict(), run_config=config))


@pytest.mark.usefixtures("server_task")
def test_the_server_records_a_refusal_whole_and_stops_when_every_site_refuses():
    longest = "x" * 64  # the longest client id: the floor and the run's setting still whole
    with pytest.raises(ReplyError) as dropped:
        parse_reply(7, _refusal(longest), None)
    reason = str(dropped.value)
    assert "dp-require-mode=local, dp-min-noise-multiplier=1.0 but the run has " \
           "dp.mode=central, dp.noise-multiplier=0.5" in reason and "\n" not in reason
    batch = Exchange(sent=[], replies=[(1, _refusal("site-0")), (2, _refusal("site-1"))])
    assert shared_failure(reply for _, reply in batch.replies).startswith(
        "ConfigError: site floor: ")
    with pytest.raises(RunFailedError) as stopped:
        stop_if_every_reply_failed("preflight before round 1", 0, batch, min_nodes=2)
    assert str(stopped.value).startswith(
        "preflight before round 1: all 2 clients that replied failed: ConfigError: site floor: "
        "dp-require-mode=local, dp-min-noise-multiplier=1.0 but the run has dp.mode=central")
    assert stopped.value.through_round == 0


# ---------------------------------------------------------------------- a real deployment
def _dropped(results: dict) -> list[dict]:
    return [d for entry in results["rounds"] for d in entry.get("dropped", [])]


@pytest.mark.integration
def test_a_deployed_site_refuses_a_run_below_its_floor_and_trains_at_it(tmp_path, forkserver):
    """Two real SuperNodes: site-0 with ``dp-min-noise-multiplier=1.0``, site-1 with
    ``dp-require-mode='central'`` (local DP meets it). Local DP at noise 0.5: site-0 refuses
    at the preflight and at its train message, each refusal one line in the server's log and
    in results.json, and site-1 trains alone; at 1.0 both train; without DP both refuse, and
    the run stops before round 1 with the refusal's line."""
    config = {"method": "fedper", "num-server-rounds": 1, "local-epochs": 1, "min-nodes": 2,
              "plot": False, "round-timeout": 120.0, "dp.mode": "local"}
    floors = {0: "dp-min-noise-multiplier=1.0", 1: "dp-require-mode='central'"}
    below, at_floor, no_dp = tmp_path / "below", tmp_path / "at", tmp_path / "no-dp"
    with LocalDeployment(2, home=tmp_path / "home", forkserver=forkserver, database=None,
                         node_configs=floors) as deployment:
        refused = deployment.run(ROOT, {**config, "dp.noise-multiplier": 0.5,
                                        "output-dir": str(below)})
        trained = deployment.run(ROOT, {**config, "dp.noise-multiplier": 1.0,
                                        "output-dir": str(at_floor)})
        stopped = deployment.run(ROOT, {**config, "dp.mode": "", "output-dir": str(no_dp)})
        site_log = (deployment.home / "site-0.log").read_text()
    line = ("site floor: dp-min-noise-multiplier=1.0 but the run has dp.noise-multiplier=0.5; "
            "this site (client site-0) does not train below its floor")
    # below site-0's floor: site-1 trains alone, site-0's refusals recorded per message
    assert refused.ok, refused.output[-3000:]
    results = read_results(below)
    (entry,) = results["rounds"]
    assert entry["train"]["num_clients"] == 1
    assert sorted(entry["eval"]["per_client"]) == ["site-1"]
    drops = _dropped(results)
    assert {d["stage"] for d in drops} >= {"identify", "train"}, drops
    assert all(line in d["reason"] for d in drops), drops
    assert len({d["node"] for d in drops}) == 1
    logged = [text for text in refused.output.splitlines() if "dropped reply" in text]
    assert logged and all(line in text for text in logged), refused.output[-3000:]
    assert f"query failed: ConfigError: {line}" in site_log  # the site's own log: one line
    # at the floor: both train, nothing dropped
    assert trained.ok, trained.output[-3000:]
    (entry,) = read_results(at_floor)["rounds"]
    assert entry["train"]["num_clients"] == 2 and not entry.get("dropped"), entry
    # no DP: below both floors; the run stops at the preflight, before round 1
    assert stopped.status == "finished:failed", (stopped.status, stopped.output[-3000:])
    results = read_results(no_dp)
    assert results["status"] == "failed"
    assert results["reason"].startswith(
        "preflight before round 1: all 2 clients that replied failed: ConfigError: site floor: ")
    assert "but the run has dp.mode='' (no DP); this site (client site-" in results["reason"]
    assert not [r for r in results["rounds"] if "train" in r], results["rounds"]
    assert results["reason"] in stopped.reason
    # the server's log: each site's refusal in a line of its own, then the stop
    logged = [text for text in stopped.output.splitlines() if "dropped reply" in text]
    assert len(logged) == 2 and all("site floor: " in text for text in logged), logged
    assert {re.search(r"this site \(client (\S+)\)", text).group(1)
            for text in logged} == {"site-0", "site-1"}, logged
    assert f"[failed] {results['reason']}" in stopped.output
