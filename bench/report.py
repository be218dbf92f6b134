"""Writing a benchmark's Markdown report: ``bench/results/<name>.md``, title, command, the code
that produced it, body."""

from __future__ import annotations

import subprocess
from pathlib import Path

from launch.app_project import app_packages

RESULTS = Path(__file__).resolve().parent / "results"


def produced_by(*paths: str) -> str:
    """The commit whose code is running, so that a table read later says which code its
    numbers belong to; ``-dirty`` when it runs with uncommitted changes to ``paths`` (default:
    the app and the benchmarks, not the results they rewrite)."""
    paths = paths or ("pyproject.toml", *app_packages(), "bench", ":(exclude)bench/results")
    try:
        changed = _git("status", "--porcelain", "--", *paths)
        return _git("describe", "--always", "--abbrev=7") + ("-dirty" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=RESULTS.parents[1], capture_output=True, text=True,
                          check=True).stdout.strip()


def write_report(name: str, title: str, command: str, body: str) -> str:
    text = f"# {title}\n\n```\n{command}\n```\n\nProduced by commit `{produced_by()}`.\n\n{body}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return text
