"""The structure the README's "How it is built" promises: layers that only point down, no
import cycles (deferred imports included), no private names across packages, one home per
method, and run-config keys declared once with their defaults only in pyproject.toml."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
from pathlib import Path

import pytest

from common.config import KeyGroup, RunSettings
from fldata import SyntheticSettings
from launch.app_project import app_defaults
from strategies.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module may import its own layer's packages or lower ones only.
LAYERS = [
    {"common"},                  # run config, message protocol, round record
    {"fldata", "models"},        # data and models (method transforms included)
    {"strategies"},              # method code and the registry
    {"client_app", "server_app"},  # the two Flower entry points
    {"comparison"},              # comparing methods over seeds: reuse or run, statistics
    {"launch"},                  # launchers and the run-config check before Flower starts
    {"bench"},                   # benchmarks and the evidence matrix
]
LAYER_OF = {package: level for level, packages in enumerate(LAYERS) for package in packages}
# method homes: package or module under strategies/ -> the method names it holds
METHOD_HOMES = {"baselines": {"fedavg", "fedprox", "local", "fedper", "fedrep", "fedbn",
                              "fedavg-ft"},
                "feddecomp": {"feddecomp"}, "pfedc": {"pfedc"},
                "factorized_fl": {"factorized-fl"}, "fedfac": {"fedfac"},
                "ditto": {"ditto"}, "fedala": {"fedala"}}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import anywhere in the file (functions included),
    relative imports resolved."""
    tree = ast.parse(path.read_text())
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((base, [alias.name for alias in node.names]))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, list[str]]]]:
    modules = {}
    for package in LAYER_OF:
        for path in (ROOT / package).rglob("*.py"):
            modules[_module_name(path)] = _imports(path)
    return modules


def _internal(name: str, modules: dict) -> str | None:
    """The project module ``name`` refers to (a module, or a package's ``__init__``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_top_level_package_has_a_layer():
    """A new top-level package is placed in ``LAYERS`` (the tests are no layer)."""
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packages == set(LAYER_OF), packages ^ set(LAYER_OF)


def test_layers_only_point_down(graph):
    upward = []
    for module, imports in graph.items():
        level = LAYER_OF[module.split(".")[0]]
        for target, _ in imports:
            top = target.split(".")[0]
            if top in LAYER_OF and LAYER_OF[top] > level:
                upward.append(f"{module} -> {target}")
    assert not upward, f"imports that point up: {upward}"


def test_no_import_cycles(graph):
    edges: dict[str, set[str]] = {}
    for module, imports in graph.items():
        for target, names in imports:
            # ``from package import name`` may name a submodule (then that is the edge)
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in graph]
            for candidate in submodules or [target]:
                resolved = _internal(candidate, graph)
                if resolved and resolved != module:
                    edges.setdefault(module, set()).add(resolved)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_packages(graph):
    crossing = [f"{module} imports {target}.{name}"
                for module, imports in graph.items() for target, names in imports
                for name in names
                if name.startswith("_") and target.split(".")[0] != module.split(".")[0]]
    assert not crossing, crossing


def test_registry_is_imported_only_by_the_entry_points(graph):
    importers = {module for module, imports in graph.items()
                 if any(t == "strategies.registry" or (t == "strategies" and "registry" in n)
                        for t, n in imports)}
    assert {m.split(".")[0] for m in importers} <= {"client_app", "server_app", "launch",
                                                    "bench"}


def test_each_method_lives_in_its_own_home(graph):
    """A method's home imports no other method's home, and the registry lists each method
    from its home."""
    for home in METHOD_HOMES:
        for module, imports in graph.items():
            if module != f"strategies.{home}" and not module.startswith(f"strategies.{home}."):
                continue
            for target, _ in imports:
                other = next((h for h in METHOD_HOMES if h != home and (
                    target == f"strategies.{h}" or target.startswith(f"strategies.{h}.")
                    or target == f"models.{h}")), None)
                assert other is None, f"{module} imports {target} (method {other})"
    assert set(REGISTRY) == set().union(*METHOD_HOMES.values())


def test_a_method_home_is_at_most_four_files():
    """Server rule, client rule, wire spec and settings under ``strategies/<method>/`` plus its
    model transform in ``models/<method>.py``: at most four files besides the record."""
    for home in METHOD_HOMES:
        package = ROOT / "strategies" / home
        files = ([p for p in package.glob("*.py") if p.name != "__init__.py"]
                 if package.is_dir() else [package.with_suffix(".py")])
        model = ROOT / "models" / f"{home}.py"
        assert len(files) + model.exists() <= 4, (home, files)


def _key_groups() -> list[type[KeyGroup]]:
    return [RunSettings, SyntheticSettings,
            *{m.settings for m in REGISTRY.values() if m.settings is not None}]


def test_every_key_is_declared_once_and_defaulted_only_in_pyproject():
    declared: dict[str, str] = {}
    for group in _key_groups():
        for spec in dataclasses.fields(group):
            if "key" not in spec.metadata:
                continue
            name = spec.metadata["key"]
            assert name not in declared, f"{name} declared by {declared.get(name)} and {group}"
            declared[name] = group.__name__
            assert spec.default is dataclasses.MISSING, f"{name} has a default in code"
            assert spec.default_factory is dataclasses.MISSING, f"{name} has a default in code"
    defaults = app_defaults(ROOT)
    assert set(declared) - set(defaults) == set(), "declared in code, missing in pyproject"
    assert set(defaults) - set(declared) == set(), "in pyproject, declared nowhere in code"
    # every default parses as its declaration says
    for group in _key_groups():
        group.parse(defaults)


def test_outside_the_engine_only_its_public_api_is_imported(graph):
    """``strategies.engine``'s ``__init__`` is the engine's public face: no module outside the
    package imports one of its collaborators' modules (ledger, node directory, messenger...)."""
    reaching_in = [f"{module} -> {target}" for module, imports in graph.items()
                   if not module.startswith("strategies.engine")
                   for target, _ in imports if target.startswith("strategies.engine.")]
    assert not reaching_in, reaching_in


ENGINE_COLLABORATORS = {"ledger", "nodes", "example_counts", "replies", "messenger",
                        "evaluation", "admission", "rule", "context", "privacy", "sampler"}


def test_the_server_app_uses_the_engines_public_face_only():
    """``server_app/`` reads the round record, the server state, the snapshot and the message
    config through ``RoundEngine``'s methods, never a collaborator's fields."""
    reaching_in = []
    for path in (ROOT / "server_app").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in ENGINE_COLLABORATORS):
                continue
            owner = node.value  # ``engine.x`` or ``self.engine.x``
            if (isinstance(owner, ast.Name) and owner.id == "engine") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "engine"):
                reaching_in.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not reaching_in, reaching_in


def _hooks_the_engine_calls() -> set[str]:
    """The attributes the engine's modules use of its rule (``self.rule.<hook>``, or
    ``rule.<hook>``)."""
    called = set()
    for path in (ROOT / "strategies" / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            if ((isinstance(owner, ast.Attribute) and owner.attr == "rule")
                    or (isinstance(owner, ast.Name) and owner.id == "rule")):
                called.add(node.attr)
    return called


def test_every_method_rule_is_a_method_rule_and_its_hooks_are_documented():
    """A method's server rule is a ``MethodRule`` (the engine holds it; it does not extend
    the engine), and every hook the engine calls is named in ``engine/rule.py``'s contract."""
    from strategies.engine import MethodRule, RoundEngine
    from strategies.engine import rule as rule_module
    from strategies.registry import load_settings, wire_spec
    from tests.conftest import app_config

    called = _hooks_the_engine_calls()
    assert {"downlink", "merge_updates", "state", "forget"} <= called, called
    undocumented = sorted(name for name in called if not callable(getattr(MethodRule, name, None))
                          or f"``{name}" not in rule_module.__doc__)
    assert not undocumented, f"hooks the engine calls, not in rule.py's list: {undocumented}"
    defined = {name for name in vars(MethodRule)
               if not name.startswith("_") and callable(getattr(MethodRule, name))}
    assert defined <= called, f"hooks nobody calls: {sorted(defined - called)}"
    for name, method in REGISTRY.items():
        assert issubclass(method.rule, MethodRule), name
        # its state is the record ``state()`` returns, not attributes named for the engine
        assert not hasattr(method.rule, "checkpointed"), name
        settings = load_settings(app_config(method=name))
        engine = RoundEngine(settings, wire_spec(settings), method.rule)
        assert type(engine.rule) is method.rule and not isinstance(engine.rule, RoundEngine)


MAX_FILE_LINES = 400


def test_no_python_file_is_over_400_lines():
    """A file holds one concern; past 400 lines it holds several (tests included)."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    too_long = {path: count for path in tracked if (ROOT / path).exists()
                and (count := len((ROOT / path).read_text().splitlines())) > MAX_FILE_LINES}
    assert tracked and not too_long, too_long
