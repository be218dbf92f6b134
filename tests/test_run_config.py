"""The launchers' reading of run-config overrides and their check before anything starts
(``launch/run_config.py``), and the rule that turns every client failing the same way into
a failed run (``common.protocol.shared_failure``)."""

from __future__ import annotations

import pytest
from flwr.app import Error, Message, RecordDict
from flwr.common.constant import ErrorCode

from common.config import ConfigError
from common.protocol import error_reason, shared_failure
from launch.app_project import app_defaults
from launch.run_config import check_run_config, parse_overrides
from server_app import tracking
from strategies.engine.exchange import Exchange
from strategies.engine.replies import RunFailedError, stop_if_every_reply_failed
from tests.conftest import ROOT

DEFAULTS = app_defaults(ROOT)


@pytest.mark.parametrize(("typed", "value"), [
    ("method=fedper", "fedper"),                 # a bare word is a string
    ("method='\"fedper\"'".replace("'", ""), "fedper"),  # TOML's own string
    ("lr=0.1", 0.1), ("seed=7", 7), ("plot=false", False),
    ("fedfac.layers=0", "0"),                    # the key is a string: taken as written
    ("fedfac.layers=0,2", "0,2"),
    ("data-root=/data/fashion mnist".replace(" ", "-"), "/data/fashion-mnist"),
    ("lr=fast", "fast"),                         # the check names the key (below)
])
def test_overrides_are_read_as_people_type_them(typed, value):
    name = typed.split("=", 1)[0]
    assert parse_overrides([typed], DEFAULTS) == {name: value}


def test_an_override_that_cannot_be_read_names_its_key():
    with pytest.raises(ConfigError, match=r"^method: cannot read the value 'fed per'"):
        parse_overrides(["method=fed per"], DEFAULTS)
    for item in ("method", "=fedper", " =fedper"):
        with pytest.raises(ConfigError, match=r"an override is key=value"):
            parse_overrides([item], DEFAULTS)


def test_a_relative_path_is_read_from_where_the_user_typed_it(tmp_path, monkeypatch):
    """The scripts run from the checkout; a relative ``dataset``, ``data-root`` or
    ``resume-from`` is the user's, in the folder they typed it in: an existing one is that
    local path, even in a hub id's ``org/name`` form; a missing one is a hub id only in
    that form, else the local path the one-line error names."""
    (tmp_path / "data" / "mine" / "a").mkdir(parents=True)
    monkeypatch.setenv("PFLOWER_CALLER_DIR", str(tmp_path))
    read = parse_overrides(["dataset=data/mine", "data-root=data", "resume-from=data/../data"],
                           DEFAULTS)
    assert read == {"dataset": str(tmp_path / "data" / "mine"), "data-root": str(tmp_path / "data"),
                    "resume-from": str(tmp_path / "data")}
    assert parse_overrides(["dataset=org/set"], DEFAULTS) == {"dataset": "org/set"}
    assert parse_overrides(["dataset=digits"], DEFAULTS) == {"dataset": "digits"}
    missing = parse_overrides(["dataset=mine.npz"], DEFAULTS)
    assert missing == {"dataset": str(tmp_path / "mine.npz")}
    with pytest.raises(ConfigError, match=rf"^dataset: no such file or directory: {tmp_path}"):
        check_run_config(missing, ROOT)


def test_the_check_names_unknown_keys_with_the_closest_known_one():
    with pytest.raises(ConfigError, match=r"^num-server-round: unknown key; did you mean "
                                          r"'num-server-rounds'\?"):
        check_run_config({"num-server-round": 3}, ROOT)
    with pytest.raises(ConfigError, match=r"^zzz: unknown key \("):
        check_run_config({"zzz": 3}, ROOT)
    with pytest.raises(ConfigError, match=r"^lr: expected float, got 'fast'"):
        check_run_config(parse_overrides(["lr=fast"], DEFAULTS), ROOT)
    assert check_run_config({"method": "fedper"}, ROOT).method == "fedper"


def test_the_check_finds_a_missing_tracker_package_before_anything_starts(monkeypatch):
    monkeypatch.setitem(tracking.REQUIREMENTS, "mlflow", ("no_such_module_xyz", "mlflow"))
    with pytest.raises(ConfigError, match=r"^tracking: mlflow not installed where the "):
        check_run_config({"tracking": "mlflow"}, ROOT)


def test_the_check_finds_missing_files_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"^dataset: no such file or directory: "):
        check_run_config({"dataset": str(tmp_path / "nothing.npz")}, ROOT)
    with pytest.raises(ConfigError, match=r"^resume-from: no checkpoint.npz in "):
        check_run_config({"resume-from": str(tmp_path)}, ROOT)
    with pytest.raises(ConfigError, match=r"^data-root: no mnist IDX files"):
        check_run_config({"dataset": "mnist", "data-root": str(tmp_path)}, ROOT)


def _error(reason: str, code: int = ErrorCode.CLIENT_APP_RAISED_EXCEPTION) -> Message:
    message = Message(RecordDict(), dst_node_id=1, message_type="train")
    return Message(Error(code=code, reason=reason), reply_to=message)


def test_a_failure_every_client_shares_is_named_and_anything_else_is_not(server_task):
    disk = error_reason(OSError("the disk is full"))
    assert disk == "OSError: the disk is full"
    assert shared_failure([_error(disk), _error(disk), _error("OSError: no space")]) == disk
    ok = Message(RecordDict(), reply_to=Message(RecordDict(), dst_node_id=1,
                                                message_type="train"))
    assert shared_failure([_error(disk), ok]) is None                 # one succeeded
    assert shared_failure([_error(disk), _error("ValueError: x")]) is None  # two kinds
    assert shared_failure([_error(disk), _error("lost", ErrorCode.NODE_UNAVAILABLE)]) is None
    assert shared_failure([]) is None
    assert error_reason(ValueError("a\n  b")) == "ValueError: a b"    # one line


def test_a_run_stops_once_min_nodes_replies_failed_alike_and_not_before(server_task):
    disk = "OSError: the disk is full"

    def failed(count: int) -> Exchange:
        return Exchange([], [(node, _error(disk)) for node in range(count)])

    stop_if_every_reply_failed("training of round 3", 3, failed(1), min_nodes=2)  # one site
    with pytest.raises(RunFailedError, match=r"^training of round 3: all 2 clients that "
                                             r"replied failed: OSError: the disk is full$") as e:
        stop_if_every_reply_failed("training of round 3", 3, failed(2), min_nodes=2)
    assert e.value.through_round == 3
