"""The app's project file, read by the tools that run the app from outside Flower (launchers,
benchmarks, tests): its run-config defaults and the packages of its bundle. Not part of the
app: it stays home."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

APP_ROOT = Path(__file__).resolve().parents[1]


def app_defaults(root: Path = APP_ROOT) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the app's ``pyproject.toml``: the run config Flower
    builds when nothing is overridden (for tools and tests that run the code outside
    Flower)."""
    return dict(_pyproject(root)["tool"]["flwr"]["app"]["config"])


def app_packages(root: Path = APP_ROOT) -> list[str]:
    """The app's Python packages (the folders of ``[tool.flwr.app] fab-include``): the code
    that travels in its bundle and that results depend on."""
    patterns = _pyproject(root)["tool"]["flwr"]["app"]["fab-include"]
    return list(dict.fromkeys(pattern.split("/", 1)[0] for pattern in patterns))


def _pyproject(root: Path) -> dict[str, Any]:
    return tomllib.loads((root / "pyproject.toml").read_text())
