"""Which tests must share a pytest-xdist worker (``scripts/test.sh`` runs ``--dist loadgroup``).

A session or module fixture is made once per worker: the tests that read one fixture's real
runs join one group, so that the runs are still made once. Imported by ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest

# fixture -> the group of the tests that use it
SHARED_RUN_FIXTURES = {"shared_runs": "shared-runs", "attack_runs": "attack-runs",
                       "compared": "compare-run", "private_runs": "privacy-runs"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, group in SHARED_RUN_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))
