"""The launchers hand ``flwr run`` a copy of what it bundles (``launch.app_project.bundle_files``)
instead of the checkout, whose ``.venv`` Flower 1.42 walks file by file before filtering: the
bundle built from the copy is the one built from the checkout, byte for byte."""

from __future__ import annotations

import hashlib

from flwr.cli.build import build_fab_from_disk

from launch.app_project import bundle_files
from tests.conftest import ROOT, copy_app


def test_the_bundle_of_the_copy_is_the_bundle_of_the_app(tmp_path):
    app = copy_app(tmp_path / "app")  # the app's files, plus what flwr run leaves out:
    (app / ".venv" / "lib").mkdir(parents=True)
    (app / ".venv" / "lib" / "module.py").write_text("x = 1\n")
    (app / "outputs").mkdir()
    (app / "outputs" / "results.json").write_text("{}")
    staged = bundle_files(app, tmp_path / "staged")
    assert not (staged / ".venv").exists() and not (staged / "outputs").exists()
    assert (hashlib.sha256(build_fab_from_disk(staged)).hexdigest()
            == hashlib.sha256(build_fab_from_disk(app)).hexdigest()
            == hashlib.sha256(build_fab_from_disk(ROOT)).hexdigest())


def test_an_app_without_fab_include_is_bundled_from_where_it_is(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.flwr.app]\npublisher = "someone"\n')
    assert bundle_files(tmp_path, tmp_path / "staged") == tmp_path
