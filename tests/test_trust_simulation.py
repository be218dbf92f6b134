"""Integration (real ``flwr run`` simulations): a ClientApp that sends every kind of malformed
reply cannot stop the run nor change the honest clients' results, and the robust aggregation
rules keep one attacker's scaled, sign-flipped updates from costing the honest clients more
than 2 points of accuracy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import copy_app, read_results

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]

# Partitions 0-2 are honest; 3-5 are malicious: every reply they send is malformed, one case
# per (round, partition) for train replies, and for evaluate and identify replies too.
MALICIOUS_CLIENT = '''
"""A test ClientApp (not shipped): partitions >= 3 send only malformed replies."""
import math

import numpy as np
from flwr.app import Array

from flwr.clientapp import ClientApp

from client_app.app import evaluate_personalized, query, train

HONEST = 3


def first(arrays):
    key = next(iter(arrays.keys()))
    return key, arrays[key].numpy()


def set_first(content, make):
    key, value = first(content["arrays"])
    content["arrays"][key] = make(value)


TRAIN_CASES = [
    ("undecodable", lambda c: set_first(c, lambda v: Array(
        str(v.dtype), v.shape, "numpy.ndarray", b"garbage"))),
    ("not-numpy", lambda c: set_first(c, lambda v: Array(
        str(v.dtype), v.shape, "torch.Tensor", Array(v).data))),
    ("real-shape", lambda c: set_first(c, lambda v: Array(
        str(v.dtype), v.shape, "numpy.ndarray", Array(v.reshape(-1)).data))),
    ("huge-shape", lambda c: set_first(c, lambda v: Array(
        str(v.dtype), (10**9, 10**9), "numpy.ndarray", Array(v).data))),
    ("missing-arrays", lambda c: c["arrays"].pop(first(c["arrays"])[0])),
    ("extra-arrays", lambda c: c["arrays"].__setitem__("evil", Array(np.zeros(3)))),
    ("list-train-loss", lambda c: c["metrics"].__setitem__("train-loss", [0.1, 0.2])),
    ("list-cpu-seconds", lambda c: c["metrics"].__setitem__("cpu-seconds", [1.0, 2.0])),
    ("1e12-examples", lambda c: c["metrics"].__setitem__("num-examples", 10**12)),
    ("superscript-id", lambda c: c["client"].__setitem__("client-id", "\\u00b2")),
    ("path-id", lambda c: c["client"].__setitem__("client-id", "../../x")),
    ("bytes-id", lambda c: c["client"].__setitem__("client-id", b"\\xff\\xfe")),
    ("no-partition-id", lambda c: c["client"].pop("partition-id")),
    ("nan-train-loss", lambda c: c["metrics"].__setitem__("train-loss", math.nan)),
    ("claims-0", lambda c: c["client"].__setitem__("client-id", "0")),  # last: a refused
]                                                                        # node gets no work
EVALUATE_CASES = [
    lambda c: c["metrics"].__setitem__("accuracy", [0.5, 0.5]),
    lambda c: c["metrics"].__setitem__("loss", [1.0]),
    lambda c: c["metrics"].__setitem__("accuracy", 7.0),
]


def corrupt(msg, context, call_next):
    pid = int(context.node_config["partition-id"])
    reply = call_next(msg, context)
    if pid < HONEST or reply.has_error():
        return reply
    content = reply.content
    kind = msg.metadata.message_type
    if kind == "train":
        server_round = int(msg.content["config"]["server-round"])
        _, change = TRAIN_CASES[((server_round - 1) * 3 + pid - HONEST) % len(TRAIN_CASES)]
        change(content)
    elif kind == "evaluate":
        EVALUATE_CASES[pid - HONEST](content)
    else:  # identify: an id that is not safe (not a claim of anyone's id)
        content["client"]["client-id"] = "\\u00b2"
    return reply


app = ClientApp(mods=[corrupt])
app.train()(train)
app.evaluate()(evaluate_personalized)
app.query()(query)
'''

# The same partitions fail every message instead (error replies): a run "without them".
ABSENT_CLIENT = '''
from flwr.clientapp import ClientApp

from client_app.app import evaluate_personalized, query, train


def fail(msg, context, call_next):
    if int(context.node_config["partition-id"]) >= 3:
        raise RuntimeError("absent")
    return call_next(msg, context)


app = ClientApp(mods=[fail])
app.train()(train)
app.evaluate()(evaluate_personalized)
app.query()(query)
'''


def _app_with(tmp: Path, name: str, source: str) -> Path:
    app_dir = copy_app(tmp / name)
    (app_dir / f"{name}.py").write_text(source)
    pyproject = app_dir / "pyproject.toml"
    # the module ships in the bundle only when the app's manifest (fab-include) names it
    pyproject.write_text(pyproject.read_text()
                         .replace('clientapp = "client_app.app:app"', f'clientapp = "{name}:app"')
                         .replace("fab-include = [", f'fab-include = ["{name}.py", '))
    return app_dir


def test_malformed_replies_are_dropped_and_honest_results_equal_a_run_without_them(
        federation, tmp_path):
    # the two-exchange protocol: every kind of reply is a message of its own (the evaluation
    # a train reply carries with fused evaluation is tested in test_trust.py)
    config = {"method": "fedavg", "num-server-rounds": 5, "local-epochs": 1, "plot": False,
              "min-nodes": 6, "fused-evaluation": False}
    results = {}
    for name, source in (("malicious_client", MALICIOUS_CLIENT),
                         ("absent_client", ABSENT_CLIENT)):
        out = tmp_path / f"out-{name}"
        run = federation.run(_app_with(tmp_path, name, source),
                             {**config, "output-dir": str(out)}, num_supernodes=6)
        assert run.ok, run.output[-3000:]
        results[name] = (read_results(out), run.output)
    bad, _ = results["malicious_client"]
    good, _ = results["absent_client"]
    assert [r["round"] for r in bad["rounds"]] == [1, 2, 3, 4, 5]
    reasons = [d["reason"] for r in bad["rounds"] for d in r.get("dropped", [])]
    train_drops = [d for r in bad["rounds"] for d in r.get("dropped", [])
                   if d["stage"] == "train"]
    assert len(train_drops) == 15  # every malformed train reply, each with its reason
    for expected in ("does not decode", "not a NumPy array", "data of shape",
                     "(1000000000, 1000000000)", "missing", "unknown ['evil']",
                     "'train-loss' must be a number", "'cpu-seconds' must be a number",
                     "exceeds aggregation.max-num-examples", "is not a safe id",
                     "'../../x'", "string 'client-id'", "partition-id",
                     "'train-loss' is not finite", "client id 0 is held by live node",
                     "'accuracy' must be a number", "'loss' must be a number",
                     "'accuracy' = 7.0 is outside"):
        assert any(expected in r for r in reasons), (expected, reasons)
    assert all(d["reason"] for r in bad["rounds"] for d in r.get("dropped", []))
    # the honest clients' results equal the run without the malicious ones
    for a, b in zip(bad["rounds"], good["rounds"], strict=True):
        assert a["train"]["num_clients"] == b["train"]["num_clients"] == 3
        assert a["train"]["loss"] == pytest.approx(b["train"]["loss"], abs=1e-9)
        assert sorted(a["eval"]["per_client"]) == ["0", "1", "2"]
        assert a["eval"]["per_client"] == pytest.approx(b["eval"]["per_client"], abs=1e-9)
    assert set(bad["server_state"]["node_to_client"].values()) == {"0", "1", "2"}


# One client (partition 4 of 5) sends its update multiplied by SCALE: -10 (sign-flipped and
# 10x larger: "flip") or 10 ("scale").
ATTACKER_CLIENT = '''
from flwr.app import Array
from flwr.clientapp import ClientApp

from client_app.app import evaluate_personalized, query, train

SCALE = {scale}


def attack(msg, context, call_next):
    reply = call_next(msg, context)
    if (int(context.node_config["partition-id"]) != 4 or reply.has_error()
            or msg.metadata.message_type != "train"):
        return reply
    received = msg.content["arrays"]
    arrays = reply.content["arrays"]
    for key in list(arrays.keys()):
        start = received[key].numpy()
        arrays[key] = Array((start + SCALE * (arrays[key].numpy() - start)).astype(start.dtype))
    return reply


app = ClientApp(mods=[attack])
app.train()(train)
app.evaluate()(evaluate_personalized)
app.query()(query)
'''
ATTACKS = {"flip": -10.0, "scale": 10.0}
# IID partitions: on skewed (Dirichlet) partitions the coordinate-wise rules themselves cost
# accuracy in few rounds (docs/security.md has both), which would hide the attacker's
# effect that this test is about.
ATTACK_BASE = {"method": "fedavg", "num-server-rounds": 6, "local-epochs": 1, "plot": False,
               "min-nodes": 5, "partitioner": "iid"}
# Honest round-1 updates of this CNN on digits are 3.7-7.2 long (L2 over all shared arrays,
# BatchNorm statistics included), later ones shorter; the clipping bound sits below them.
OPTIONS = {"mean": {},
           "median": {"aggregation.rule": "median"},
           "trimmed-mean": {"aggregation.rule": "trimmed-mean",
                            "aggregation.trim-fraction": 0.2},
           "clip-norm": {"aggregation.clip-norm": 2.0}}
# which attack each robust option is tested on (clipping bounds a scaled update, not its sign)
DEFENDS = {"median": "flip", "trimmed-mean": "flip", "clip-norm": "scale"}
RUNS = [*[(None, option) for option in OPTIONS],
        *[("flip", option) for option in ("mean", "median", "trimmed-mean")],
        *[("scale", option) for option in ("mean", "clip-norm")]]


def honest_accuracy(results: dict) -> float:
    """Mean final personalized accuracy of the honest clients (0-3). A client without a valid
    evaluation in the last round counts as 0: when the shared model diverges, its loss is not
    finite and the server drops its evaluate reply (with none left, the run fails)."""
    per_client = results["rounds"][-1].get("eval", {}).get("per_client", {})
    return sum(per_client.get(str(c), 0.0) for c in range(4)) / 4


@pytest.fixture(scope="module")
def attack_runs(federation, tmp_path_factory):
    """(attack or None, option) -> final honest accuracy; the table is printed (README)."""
    tmp = tmp_path_factory.mktemp("attack")
    apps = {None: ROOT, **{name: _app_with(tmp, f"attacker_{name}",
                                           ATTACKER_CLIENT.format(scale=scale))
                           for name, scale in ATTACKS.items()}}
    accuracy = {}
    for attack, option in RUNS:
        out = tmp / f"{attack}-{option}"
        run = federation.run(apps[attack], {**ATTACK_BASE, **OPTIONS[option],
                                            "output-dir": str(out)}, num_supernodes=5)
        results = read_results(out)
        # unopposed, the attacker may wreck the shared model: every client's training
        # diverges, and the run says so (failed) after three such rounds, or, where fewer
        # are left, no finite evaluation is left after its last round
        wrecked = (attack is not None and option == "mean" and run.status == "finished:failed"
                   and (results["reason"].endswith("the run diverged")
                        or results["reason"].startswith("round 6: no client's evaluation"))
                   and len(results["rounds"]) <= 6)
        assert run.ok or wrecked, run.output[-3000:]
        accuracy[attack, option] = honest_accuracy(results)
    print("| option | no attacker | " + " | ".join(f"attacker: {a}" for a in ATTACKS) + " |")
    for option in OPTIONS:
        cells = [accuracy.get((a, option)) for a in (None, *ATTACKS)]
        print(f"| {option} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells)
              + " |")
    return accuracy


@pytest.mark.parametrize("option", list(DEFENDS))
def test_a_robust_option_keeps_the_honest_clients_within_two_points(attack_runs, option):
    """With the option on, the attacker costs the honest clients at most 2 points against
    the same federation without it."""
    attacked = attack_runs[DEFENDS[option], option]
    assert attacked >= attack_runs[None, option] - 0.02, attack_runs


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_without_a_robust_option_the_attacker_costs_accuracy(attack_runs, attack):
    assert attack_runs[attack, "mean"] < attack_runs[None, "mean"] - 0.1, attack_runs
