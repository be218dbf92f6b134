"""Repository hygiene: what a fresh clone gets must work on any machine.

A tracked symlink to a path outside the checkout (a ``.venv`` pointing at some machine's
environment) dangles on every other machine; tracked virtualenvs, run outputs, certificates,
keys or client state leak local artefacts (and secrets) into every clone and into the Flower
app bundle."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import APP_PACKAGES

ROOT = Path(__file__).resolve().parent.parent

# Paths the ignore rules must cover, whatever form they take (a symlink named .venv is a
# file to git, not a directory): virtualenvs, outputs, Flower homes, certificates and keys,
# the deployment's local state and site folders.
MUST_BE_IGNORED = [
    ".venv",  # as a file or symlink
    ".venv/bin/python",
    "venv/bin/python",
    "outputs/20260101T000000-fedavg/results.json",
    ".flwr/config.toml",
    "deploy/certs/ca.key",
    "deploy/certs/server.pem",
    "deploy/keys/site-0",
    "deploy/state/state.db",
    "deploy/sites/site-0/state/0.pt",
    "deploy/sites/site-0/data/train.npz",
    "deploy/outputs/first/checkpoint.pkl",
    "deploy/secrets/site-0",
    "deploy/flwr-home/config.toml",
    "deploy/engine/dockerd.log",
    "deploy/wheelhouse/cp311/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl",
    "certs/ca.crt",
    "device-key.pem",
]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    return [line for line in _git("ls-files", "-z").split("\0") if line]


def test_no_tracked_symlink_leaves_the_repository(tracked: list[str]) -> None:
    escaping = []
    for line in _git("ls-files", "-s", "-z").split("\0"):
        if not line.startswith("120000 "):
            continue
        path = line.split("\t", 1)[1]
        target = _git("cat-file", "blob", line.split()[1])
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
        if os.path.isabs(target) or resolved == ".." or resolved.startswith("../"):
            escaping.append(f"{path} -> {target}")
    assert not escaping, f"tracked symlinks point outside the repository: {escaping}"


def test_ignore_rules_cover_local_artefacts(tracked: list[str]) -> None:
    not_ignored = [p for p in MUST_BE_IGNORED
                   if subprocess.run(["git", "check-ignore", "-q", "--no-index", p],
                                     cwd=ROOT).returncode != 0]
    assert not not_ignored, f".gitignore does not cover {not_ignored}"


def test_nothing_tracked_is_ignored(tracked: list[str]) -> None:
    """A tracked path that the ignore rules exclude was committed by mistake (``git add -f``,
    or before the rule existed)."""
    offending = [p for p in _git("ls-files", "-ci", "--exclude-standard", "-z").split("\0") if p]
    assert not offending, f"tracked paths match .gitignore: {offending}"


def test_the_app_bundle_holds_the_app_and_every_path_fits_its_manifest() -> None:
    """``flwr run .`` ships this directory as a FAB whose manifest lists ``path,sha256,bits``
    per file, unquoted: one file name with a comma anywhere under the app (a benchmark cell
    named after a two-key config did this) fails every run at the SuperExec. Benchmarks and
    their results are no part of the app, nor are the launchers (``launch/``: they start
    processes on the machine that runs the demo, tests and benchmarks)."""
    import io
    import zipfile

    from flwr.cli.build import build_fab_from_disk

    names = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).namelist()
    packages = set(APP_PACKAGES)
    assert {n.split("/")[0] for n in names} == packages | {"pyproject.toml", ".info"}
    shipped = {n for n in names if n.endswith(".py")}
    on_disk = {str(p.relative_to(ROOT)) for pkg in packages for p in (ROOT / pkg).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert shipped == on_disk
    assert [n for n in names if "," in n] == []
    assert not [n for n in names if n.startswith("launch/")]
    assert (ROOT / "launch" / "federation.py").exists()  # the launcher is there, not shipped
