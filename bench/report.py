"""Writing a benchmark's Markdown report: ``bench/results/<name>.md``, title, command, body."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_report(name: str, title: str, command: str, body: str) -> str:
    text = f"# {title}\n\n```\n{command}\n```\n\n{body}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return text
