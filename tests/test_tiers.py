"""The suite's own machinery: tests that read one shared run go to one pytest-xdist worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tests_that_read_one_shared_fixture_run_in_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "import pytest\n"
        "from tests.grouping import pytest_collection_modifyitems  # noqa: F401\n\n"
        "@pytest.fixture(scope='session')\ndef shared_runs():\n    return None\n")
    (tmp_path / "test_grouped.py").write_text(
        "import json, os, pytest\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_reads_the_shared_run(shared_runs, i, tmp_path_factory):\n"
        "    with open(os.environ['WORKERS_FILE'], 'a') as f:\n"
        "        f.write(json.dumps(os.environ['PYTEST_XDIST_WORKER']) + '\\n')\n\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_free(i):\n    pass\n")
    workers = tmp_path / "workers.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup",
         "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "WORKERS_FILE": str(workers)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "12 passed" in done.stdout
    seen = [json.loads(line) for line in workers.read_text().splitlines()]
    assert len(seen) == 6 and len(set(seen)) == 1, seen
