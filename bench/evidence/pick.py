"""What to pick, per scenario, at its rounds R (every row ran them): a ``pick`` a user can read.

- ``run``: the stable row with the best mean accuracy over the report seeds. A row is stable
  when none of its report seeds is unstable (diverged or collapsed: ``stats.unstable``), the
  same rule for every row; an unstable row is never ``run`` or ``also`` (a user running it may
  meet that seed), however high its other seeds.
- ``also``: the stable rows within the non-inferiority margin of it, one point at equal
  rounds: the 95% interval of their paired difference against it lies at or above -1 point
  (``judge_difference``, the claims' rule). Not "an interval that includes 0", which calls a
  noisy row tied through its spread.
- ``avoid``: the unstable rows, and the rows clearly worse: their interval lies wholly below
  -1 point.
- the others (an interval across -1 point) are ``undecided``: neither picked nor avoided.

A row still missing report seeds, or one whose search or scenario rounds are not settled, is
``provisional``; a row without an interval against ``run`` (one common seed) is ``missing``.
The report's "What to pick" gives one line per scenario, with each row's rounds and uplink a
round; its "README lines" the same picks in at most ``README_LINE_CHARS`` characters a line, the
README's benchmark section.
"""

from __future__ import annotations

from typing import Any

from bench.evidence.claims import complete
from bench.evidence.protocol import SCENARIOS
from bench.evidence.stats import flag, report_seeds_stats, uplink_per_round
from comparison.stats import accuracy_difference, judge_difference, points, seeds_named

MARGIN = -0.01  # one point, the claims' non-inferiority margin
README_LINE_CHARS = 200  # the README's longest line


def picks(stats: dict[str, dict[str, dict[str, Any]]],
          every_seed_diverged: dict[str, list[str]] | None = None
          ) -> dict[str, dict[str, Any]]:
    """scenario -> ``run`` (a label, None where no row is stable), ``also`` and ``undecided``
    (label -> paired difference against ``run``), ``avoid`` (label -> why), ``missing``,
    ``provisional`` (``every_seed_diverged``: scenario -> rows not in ``stats`` because every
    report seed of theirs diverged: avoided)."""
    out = {}
    for scenario, rows in stats.items():
        gone = (every_seed_diverged or {}).get(scenario, [])
        avoid = {label: f"unstable: {seeds_named(r['unstable_seeds'])} "
                        f"({'; '.join(sorted(set(r['unstable_why'].values())))})"
                 for label, r in rows.items() if r.get("unstable_seeds")}
        avoid.update({label: "diverged on every report seed" for label in gone})
        ranked = sorted((r for r in rows.values() if r["label"] not in avoid),
                        key=lambda r: report_seeds_stats(r)[0], reverse=True)
        missing = [e.label for e in SCENARIOS[scenario].entries
                   if e.label not in rows and e.label not in gone]
        pick: dict[str, Any] = {"run": None, "also": {}, "avoid": avoid, "undecided": {},
                                "missing": missing, "provisional": []}
        out[scenario] = pick
        if not ranked:
            continue
        best = ranked[0]
        pick["run"] = best["label"]
        for r in ranked[1:]:
            difference = accuracy_difference(r, best)
            judged = judge_difference(difference, MARGIN)
            if judged["interval"] is None:  # one common seed: not judged yet
                pick["missing"].append(r["label"])
            elif judged["interval"] == "above the margin":
                pick["also"][r["label"]] = difference
            elif judged["interval"] == "below the margin":
                avoid[r["label"]] = f"below it: {points(difference)}"
            else:
                pick["undecided"][r["label"]] = difference
        pick["provisional"] = [label for label in [best["label"], *pick["also"]]
                               if not complete(rows[label]) or not rows[label].get(
                                   "rounds_fixed", True) or flag(rows[label])]
    return out


def pick_lines(picked: dict[str, dict[str, Any]], stats: dict[str, dict[str, dict[str, Any]]]
               ) -> str:
    """Markdown: one line per scenario."""
    lines = []
    for scenario, pick in picked.items():
        rows = stats[scenario]

        def uplink(label: str, rows: dict[str, dict[str, Any]] = rows) -> str:
            return f"{uplink_per_round(rows[label]):.2f} MB a round"

        if pick["run"] is None:
            lines.append(f"- **{scenario}**: nothing to run: every row in so far is unstable "
                         f"({', '.join(pick['avoid'])})")
            continue
        best = rows[pick["run"]]
        mean, std = report_seeds_stats(best)
        also = "; ".join(f"{label} {points(d)}, {uplink(label)}"
                         for label, d in pick["also"].items()) or "none"
        avoid = "; ".join(f"{label} ({why})" for label, why in pick["avoid"].items()) or "none"
        notes = ([f"not in yet: {', '.join(pick['missing'])}"] if pick["missing"] else []) + (
            [f"provisional until their search, rounds, seeds and slope settle: "
             f"{', '.join(pick['provisional'])}"] if pick["provisional"] else [])
        lines.append(f"- **{scenario}** ({best['num_rounds']} rounds): run **{pick['run']}** "
                     f"{100 * mean:.1f} ± {100 * std:.1f}, {uplink(pick['run'])}; also within 1 "
                     f"point: {also}; avoid: {avoid}"
                     + (f" ({'; '.join(notes)})" if notes else ""))
    return "\n".join(lines) + "\n"


def readme_lines(picked: dict[str, dict[str, Any]], stats: dict[str, dict[str, dict[str, Any]]]
                 ) -> str:
    """The README's benchmark section, one line per scenario of ``SCENARIOS`` of at most
    ``README_LINE_CHARS`` characters: what to run, with its accuracy, rounds and uplink a
    round; what is within a point, each with its uplink a round; what to avoid; "provisional"
    while any row of the scenario may still change it (not in, its seeds or rounds not
    settled). Where that is too long the uplinks within a point go first, then the rows past
    those that fit, avoided ones before those within a point (``+N more``: the report names
    them)."""
    lines = []
    for scenario in SCENARIOS:
        pick, rows = picked.get(scenario), stats.get(scenario, {})
        if pick is None:
            lines.append(f"- **{scenario}**: not in yet")
            continue
        unsettled = bool(pick["missing"] or pick["provisional"]) or any(
            not complete(r) or not r.get("rounds_fixed", True) for r in rows.values())
        avoid = ("; avoid: ", list(pick["avoid"]))
        if pick["run"] is None:
            lines.append(_fit(f"- **{scenario}**{' (provisional)' if unsettled else ''}: "
                              "nothing to run, every row in is unstable", [avoid]))
            continue
        best = rows[pick["run"]]
        head = (f"- **{scenario}** ({'provisional, ' if unsettled else ''}"
                f"{best['num_rounds']} rounds): run **{pick['run']}** "
                f"{100 * report_seeds_stats(best)[0]:.1f} "
                f"({uplink_per_round(best):.2f} MB a round)")
        whole = _fit(head, [("; within 1 point: ", [
            f"{label} ({uplink_per_round(rows[label]):.2f} MB)" for label in pick["also"]]),
            avoid], shorten=False)
        lines.append(whole if len(whole) <= README_LINE_CHARS
                     else _fit(head, [("; within 1 point: ", list(pick["also"])), avoid]))
    return "\n".join(lines) + "\n"


def _fit(head: str, sections: list[tuple[str, list[str]]], shorten: bool = True) -> str:
    """``head``, then each section's lead and names, as many names as keep the line within
    ``README_LINE_CHARS`` (``+N more`` for the rest), the last section cut first; the
    shortest such line where none fits. ``shorten``: False, every name."""
    shown = [len(names) for _, names in sections]
    while True:
        line = head + "".join(
            lead + (", ".join(names[:k] + ([f"+{len(names) - k} more"] if k < len(names)
                                           else [])) or "none")
            for (lead, names), k in zip(sections, shown, strict=True))
        cuttable = [i for i, k in enumerate(shown) if k > 0]
        if len(line) <= README_LINE_CHARS or not shorten or not cuttable:
            return line
        shown[cuttable[-1]] -= 1
