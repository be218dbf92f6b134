"""What to pick, per scenario: the row with the best accuracy over the report seeds (which
every complete row has; one still missing some is marked provisional), and the rows
statistically tied with it (the 95% interval of their paired difference against it, over the
seeds both ran, does not exclude 0), with each one's uplink. A row that diverged on a report
seed is never picked (a user running it may meet that split), only named. The table the
report, and the README's benchmark section, open with."""

from __future__ import annotations

from typing import Any

from bench.evidence.claims import complete
from bench.evidence.protocol import SCENARIOS
from bench.evidence.stats import diverged_report_seeds, flag, report_seeds_stats
from comparison.stats import accuracy_difference, points


def picks(stats: dict[str, dict[str, dict[str, Any]]],
          every_seed_diverged: dict[str, list[str]] | None = None
          ) -> dict[str, dict[str, Any]]:
    """scenario -> the best row's label (None where every row diverged on a report seed), the
    tied rows' paired differences against it (label -> ``paired_difference``), the scenario's
    rows not in yet (no cells, or no interval against the best), the picked rows that had not
    converged or finished their search, and the rows that diverged on a report seed (with
    ``every_seed_diverged``, scenario -> the rows not in ``stats`` because every report seed
    of theirs diverged)."""
    out = {}
    for scenario, rows in stats.items():
        gone = (every_seed_diverged or {}).get(scenario, [])
        diverged = [r["label"] for r in rows.values() if diverged_report_seeds(r)] + gone
        ranked = sorted((r for r in rows.values() if r["label"] not in diverged),
                        key=lambda r: report_seeds_stats(r)[0], reverse=True)
        missing = [e.label for e in SCENARIOS[scenario].entries
                   if e.label not in rows and e.label not in gone]
        if not ranked:
            out[scenario] = {"best": None, "tied": {}, "missing": missing, "provisional": [],
                             "diverged": diverged}
            continue
        best = ranked[0]
        differences = {r["label"]: accuracy_difference(r, best) for r in ranked[1:]}
        # a row without an interval against the best (a single common seed) is not judged yet
        unjudged = [label for label, d in differences.items() if d is None or d["ci95"] is None]
        tied = {label: d for label, d in differences.items()
                if label not in unjudged and d["ci95"][1] >= 0}
        picked = [best["label"], *tied]
        out[scenario] = {
            "best": best["label"], "tied": tied,
            "missing": missing + unjudged,
            "provisional": [label for label in picked
                            if not complete(rows[label]) or flag(rows[label])],
            "diverged": diverged}
    return out


def pick_table(picked: dict[str, dict[str, Any]], stats: dict[str, dict[str, dict[str, Any]]]
               ) -> str:
    """Markdown: one line per scenario."""
    lines = ["| scenario | best: accuracy on the report seeds (mean ± std), uplink MB | "
             "statistically tied with it: difference in points [95% interval], uplink MB |",
             "|---|---|---|"]
    for scenario, pick in picked.items():
        rows = stats[scenario]
        if pick["best"] is None:
            lines.append(f"| {scenario} | none: every row in so far diverged on a report seed "
                         f"({', '.join(pick['diverged'])}) | |")
            continue
        best = rows[pick["best"]]
        mean, std = report_seeds_stats(best)
        tied = "; ".join(f"{label} {points(d)}, {rows[label]['mb_up'][0]:.0f} MB"
                         for label, d in pick["tied"].items()) or "none"
        notes = ([f"not in yet: {', '.join(pick['missing'])}"] if pick["missing"] else []) + (
            [f"still provisional (search, seeds or convergence): "
             f"{', '.join(pick['provisional'])}"]
            if pick["provisional"] else []) + (
            [f"diverged on a report seed, not picked: {', '.join(pick['diverged'])}"]
            if pick["diverged"] else [])
        lines.append(f"| {scenario} | **{pick['best']}**: {100 * mean:.1f} ± {100 * std:.1f}, "
                     f"{best['mb_up'][0]:.0f} MB | {tied}"
                     + (f" ({'; '.join(notes)})" if notes else "") + " |")
    return "\n".join(lines) + "\n"
