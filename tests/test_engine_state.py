"""The engine's state contract (``strategies/engine/``): every collaborator changes only its
own attributes, and what a later stage needs travels as a value (the round's plan, what a
stage returns), never as an attribute one object leaves for another to read.

The check walks the engine's modules (AST): inside a method, ``self.<x>`` is the object's
own; anything reached through one of its attributes (``self.evaluation.x``,
``self.ledger.record(r).eval``) or through a function's parameters (``nodes.live``) belongs
to another object, and is changed only by calling that object's methods. Calls on the way
are followed (``self.ledger.record(r).eval = ...`` writes the ledger's record).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from common.protocol import NUM_EXAMPLES, ClientReply
from strategies.engine.privacy import PrivacyLedger
from strategies.registry import load_settings
from tests.conftest import app_config

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "strategies" / "engine"

# methods that change the container they are called on
MUTATORS = {"add", "append", "clear", "difference_update", "discard", "extend", "insert",
            "intersection_update", "pop", "popitem", "remove", "setdefault",
            "symmetric_difference_update", "update", "__setitem__", "__delitem__"}


def _path(node: ast.expr) -> tuple[str, list[str]] | None:
    """(root name, attributes after it) of an expression like ``self.a.b[k].c`` (a call
    ``x.m(...)`` stands for ``x``; ``getattr(x, name)`` for an unknown attribute of ``x``);
    None if it does not start at a name."""
    attributes: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            attributes.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call):
            if (isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and node.args):
                attributes.append("?")
                node = node.args[0]
            elif isinstance(node.func, ast.Attribute):
                node = node.func.value  # the object whose method is called
            else:
                return None
        elif isinstance(node, ast.Name):
            return node.id, attributes[::-1]
        else:
            return None


def _foreign(target: ast.expr, parameters: set[str], subscripted: bool = False) -> bool:
    """Whether changing ``target`` changes another object: something reached through one
    of ``self``'s attributes, or an attribute of a parameter."""
    found = _path(target)
    if found is None:
        return False
    root, attributes = found
    if root == "self":
        # self.x = ..., self.x[k] = ..., self.x.update(...): the object's own
        return len(attributes) >= 2
    return root in parameters and (len(attributes) >= 1 or subscripted)


def foreign_writes(source: str, name: str = "<source>") -> list[str]:
    """Every statement of ``source`` that changes another object's attributes (module
    docstring), as ``name:line: code``."""
    tree = ast.parse(textwrap.dedent(source))
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        arguments = function.args
        parameters = {a.arg for a in [*arguments.posonlyargs, *arguments.args,
                                      *arguments.kwonlyargs]} - {"self", "cls"}
        for node in ast.walk(function):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
                    targets = [func.value]
                elif (isinstance(func, ast.Name) and func.id in {"setattr", "delattr"}
                      and node.args):
                    targets = [ast.Attribute(node.args[0], "?", ast.Store())]
            flat = [t for target in targets for t in (
                target.elts if isinstance(target, ast.Tuple | ast.List) else [target])]
            for target in flat:
                if isinstance(target, ast.Name):
                    continue
                # a call's receiver is a container as a whole (x.update() counts like x[k] =)
                if _foreign(target, parameters, subscripted=isinstance(
                        target, ast.Subscript) or isinstance(node, ast.Call)):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_the_check_catches_a_write_to_another_objects_attributes():
    """Each pattern the engine once had fails the check; the object's own state does not."""
    caught = [
        "self.evaluation.rejoined_at_evaluate.update(rejoined.values())",
        "self.evaluation.per_client_accuracy.pop(client_id, None)",
        "self.example_counts.pinned.pop(client_id, None)",
        "self.evaluation.per_client_accuracy = dict(state['per_client_accuracy'])",
        "self.nodes.last_seen = dict(state.get('last_seen', {}))",
        "self.privacy.releases[sample] = 1",
        "self.messenger.message_config = dict(config)",
        "self._nodes.excluded_clients.add(client_id)",
        "self.ledger.history[state['round']] = record",
        "self.ledger.record(server_round).train = train",
        "self.ledger.record(server_round).extra.setdefault('rejoined', {}).update(scores)",
        "setattr(self.rule, name, state[name])",
        "getattr(self.rule, name).pop(client_id, None)",
        "del self.nodes.last_seen[client_id]",
        "other.attr.update(x)",
        "other.attr = 1",
        "other[k] = 1",
    ]
    for line in caught:
        assert foreign_writes(f"def f(self, other, k, x):\n    {line}\n"), line
    own = ["self.drawn, self.asked = clients, asked", "self.pinned.setdefault(c, {})[s] = 1",
           "self.record(server_round).eval = stats", "self.history[r] = RoundRecord()",
           "del self.last_seen[client_id]", "merged[key] = value", "self.x += 1",
           "local = other.table\nlocal2 = dict(local)\nlocal2[k] = 1",
           "self.nodes.expire(server_round)", "self.evaluation.forget(client_id)"]
    for line in own:
        assert not foreign_writes(f"def f(self, other, k):\n    {line}\n"), line


def test_no_engine_collaborator_writes_another_objects_attributes():
    found = [hit for path in sorted(ENGINE.glob("*.py"))
             for hit in foreign_writes(path.read_text(), path.name)]
    assert not found, "\n".join(found)


# ---------------------------------------------------------------------- values, not leftovers
def _reply(client: str, values: np.ndarray) -> ClientReply:
    return ClientReply(100 + int(client), client, ArrayRecord({"w": Array(values)}),
                       MetricRecord({NUM_EXAMPLES: 10}), ConfigRecord())


@pytest.mark.parametrize("mode", ["central", "local"])
def test_the_privacy_ledger_keeps_between_calls_only_what_its_checkpoint_holds(mode):
    """A round's draw travels in its plan and the merge's clipping comes back from the
    merge: after a round the ledger holds nothing a ledger restored from its ``state()``
    lacks (once it kept the round's draw and merge in attributes for ``account``)."""
    settings = load_settings(app_config(**{"dp.mode": mode, "dp.noise-multiplier": 1.0,
                                           "dp.clip-norm": 1.0}))
    ledger = PrivacyLedger(settings, np.random.default_rng(0))
    ledger.fix_population({str(i): {"num-partitions": 8} for i in range(8)})
    draw = (["0", "1", "2"], 8)
    ledger.check_budget(draw)
    note = None
    if mode == "central":
        start = ArrayRecord({"w": Array(np.zeros(4, np.float32))})
        _, note = ledger.merge([_reply("0", np.ones(4, np.float32))], ["w"], start,
                               drawn=len(draw[0]))
    ledger.account(draw, merged=True, note=note)
    restored = PrivacyLedger(settings, ledger._rng)
    restored.restore(ledger.state())
    assert vars(restored) == vars(ledger)


# ---------------------------------------------------------------------- the checkpoint
def _pfedc_engine():
    from strategies.engine import RoundEngine
    from strategies.registry import REGISTRY, wire_spec

    settings = load_settings(app_config(method="pfedc"))
    return RoundEngine(settings, wire_spec(settings), REGISTRY["pfedc"].rule)


def test_the_snapshot_keeps_each_collaborators_state_under_its_own_key(tmp_path):
    """The rule's record under ``rule``: a rule table named like an engine's (``last_seen``)
    cannot collide; saved and loaded as the checkpoint is."""
    from common.durable import load_tree, save_tree

    engine = _pfedc_engine()
    assert engine.nodes.claim(7, "a", 2) is None
    engine.evaluation.record(2, {"a": (0.5, 10)})
    engine.rule.task_weights["a"] = [1.0, 0.0]
    snapshot = engine.snapshot(2)
    assert set(snapshot) == {"nodes", "evaluation", "example_counts", "rule", "random"}
    assert snapshot["rule"]["task_weights"] == {"a": [1.0, 0.0]}
    save_tree(tmp_path / "checkpoint.npz", snapshot)
    resumed = _pfedc_engine()
    resumed.restore(load_tree(tmp_path / "checkpoint.npz"))
    assert resumed.snapshot(2) == engine.snapshot(2)


def test_a_checkpoint_of_the_layout_before_resumes():
    """Before, the engine's tables and the rule's attributes shared one ``strategy`` dict
    and the pending evaluation had a key of its own."""
    engine = _pfedc_engine()
    engine.restore({"strategy": {"per_client_accuracy": {"a": 0.5}, "last_seen": {"a": 2},
                                 "example_counts": {"a": {"train": 10}},
                                 "task_weights": {"a": [1.0]}, "branches": {}},
                    "pending_evaluation": {"round": 2, "clients": ["a"], "asked": False,
                                           "record": {}}})
    assert engine.evaluation.per_client_accuracy == {"a": 0.5}
    assert engine.nodes.last_seen == {"a": 2} and engine.example_counts.pinned["a"]["train"] == 10
    assert engine.rule.task_weights == {"a": [1.0]} and engine.rule.branches == {}
    assert engine.snapshot(2)["rule"] == {"task_weights": {"a": [1.0]}, "branches": {}}
    assert engine.evaluation.asked is False
