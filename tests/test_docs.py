"""The documentation as a map: the README stays short (lines and characters), the loopback
recipe lives on the deployment page, and every relative link in the README, in docs/ and in
bench/README.md leads somewhere (a file or folder, and a heading when the link names an
anchor)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.evidence.pick import README_LINE_CHARS
from bench.evidence.protocol import SCENARIOS

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 180
README_MAX_LINE_CHARS = README_LINE_CHARS  # the evidence report writes its lines to fit
PAGES = sorted([ROOT / "README.md", ROOT / "bench" / "README.md",
                *(ROOT / "docs").rglob("*.md")])

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) or [text](target "title"); images (![alt](src)) are links too
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def prose(text: str) -> list[str]:
    """The paragraphs outside fenced code blocks, with inline code spans (which may run over
    a line break) blanked out, so that a link split over two lines is still seen."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            kept.append("")
        elif not fenced:
            kept.append(line)
    paragraphs = "\n".join(kept).split("\n\n")
    return [INLINE_CODE.sub("", paragraph) for paragraph in paragraphs]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, drop what is not a letter, digit, space,
    ``-`` or ``_`` (markup included), spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's slug on ``page``, with GitHub's ``-1``, ``-2`` for repeats."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    return [target for paragraph in prose(page.read_text(encoding="utf-8"))
            for target in LINK.findall(paragraph)]


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` that lead nowhere, each with the reason."""
    broken = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file or folder")
        elif anchor and destination.is_file() and anchor not in anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.name}")
    return broken


def test_the_readme_is_a_map_of_at_most_180_lines_of_at_most_200_characters():
    """Detail goes to the page a section links, not into ever-longer lines."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    long = [f"line {n}: {len(line)} characters" for n, line in enumerate(lines, 1)
            if len(line) > README_MAX_LINE_CHARS]
    assert long == [], long


def test_the_readmes_benchmark_section_fits_a_screen_with_one_line_per_kind_of_data():
    """At most 25 lines under its heading; a bullet per scenario of the evidence matrix, named
    by its key, as ``bench/evidence/pick.py``'s ``readme_lines`` writes them."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0].strip("\n")
    lines = section.splitlines()
    assert len(lines) <= 25, f"the benchmark section has {len(lines)} lines"
    named = [line.split("**")[1] for line in lines if line.startswith("- **")]
    assert named == list(SCENARIOS)


def test_the_loopback_recipe_is_on_the_deployment_page():
    """``tests/test_deployment_loopback.py`` runs the bash block under the marker in
    docs/deployment.md; the marker is there once, right above that block, and nowhere else."""
    marker = "<!-- loopback-recipe -->"
    page = (ROOT / "docs" / "deployment.md").read_text(encoding="utf-8")
    assert page.count(marker) == 1
    assert page.split(marker, 1)[1].startswith("\n```bash\n")
    assert marker not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_pages_are_all_there():
    names = {page.relative_to(ROOT).as_posix() for page in PAGES}
    assert {"README.md", "bench/README.md", "docs/contracts.md", "docs/security.md",
            "docs/deployment.md", "docs/data.md", "docs/testing.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], page.relative_to(ROOT).as_posix()


def test_the_link_check_sees_what_is_broken(tmp_path):
    """The checker itself: a missing file, a missing heading and a link in code are told
    apart; GitHub's slug rule holds for punctuation, code and repeated headings."""
    (tmp_path / "other.md").write_text("# Other\n## Durable state, faults and resume\n")
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading: §2 run_config\n## Twice\n## Twice\n"
                    "[ok](other.md) [ok](other.md#durable-state-faults-and-resume)\n"
                    "[ok](#a-code-heading-2-run_config) [ok](#twice-1) [ok](https://x.org/y)\n"
                    "[gone](missing.md) [gone](other.md#nowhere) `[code](missing.md)`\n"
                    "[split over\ntwo lines](gone.md) `code over\ntwo [lines](missing.md)`\n"
                    "```\n[fenced](missing.md)\n```\n")
    assert broken_links(page) == ["missing.md: no such file or folder",
                                  "other.md#nowhere: no heading #nowhere in other.md",
                                  "gone.md: no such file or folder"]


USER_PAGES = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]


def test_every_run_config_key_is_documented():
    """Each key of ``[tool.flwr.app.config]`` is named, in code, on a user's page (the README
    or ``docs/``): a key added without a word for its user fails here."""
    from launch.app_project import app_defaults

    text = "\n".join(page.read_text(encoding="utf-8") for page in USER_PAGES)
    named = set(re.findall(r"`([a-z0-9.\-]+)", text))  # `key`, `key = value`, `key=value`
    assert sorted(set(app_defaults()) - named) == []
