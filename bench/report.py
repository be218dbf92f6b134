"""Writing a benchmark's Markdown report: ``bench/results/<name>.md``, title, command, the code
that produced it, body."""

from __future__ import annotations

import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def produced_by() -> str:
    """The commit whose code is running (``-dirty``: with uncommitted changes), so that a
    table read later says which code its numbers belong to."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              cwd=RESULTS.parent, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def write_report(name: str, title: str, command: str, body: str) -> str:
    text = f"# {title}\n\n```\n{command}\n```\n\nProduced by commit `{produced_by()}`.\n\n{body}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return text
