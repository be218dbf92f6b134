"""What ``scripts/compare.sh`` writes (``launch/compare.py``): ``report.md``, ``summary.json``
and two plots, from the summary of ``comparison/stats.py``'s statistics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from comparison.plots import draw_accuracy_vs_uplink, draw_curves, figure, save
from comparison.stats import CONVERGED_SLOPE, LAST_ROUNDS, SLOPE_ROUNDS, config_tag, points

FEW_SEEDS = 3  # below this, a 95% interval over seeds is too wide to tell anything apart


def report_markdown(summary: dict[str, Any], command: str) -> str:
    """The report: every accuracy and difference in points (percent), the slope over the
    rounds it was computed on, a warning where too few seeds make the intervals
    uninformative."""
    protocol = summary["protocol"]
    reference = protocol["reference"]
    margin = 100 * protocol["margin"]
    budget = protocol["budgets"]
    seeds = protocol["seeds"]
    rounds = max((len(c) for row in summary["rows"].values() for c in row["curves"].values()),
                 default=0)
    window = min(SLOPE_ROUNDS, rounds)
    lines = [
        "# Comparison\n", f"```\n{command}\n```\n",
        f"Seeds {', '.join(map(str, seeds))}; a row with a grid was tuned on seed "
        f"{protocol['tuning_seed']}, each configuration scored on validation splits "
        f"({protocol['validation_fraction']:.0%} of every client's training share; never a "
        "test split), and the one with the best mean validation accuracy over its last "
        f"{LAST_ROUNDS} rounds kept. Every figure is in accuracy points (percent). Accuracy: "
        "personalized, weighted by test examples, mean of the last "
        f"{min(LAST_ROUNDS, rounds)} evaluated rounds, then mean ± standard deviation over "
        "seeds (never the best round). Min client: the same for the lowest client. Slope: "
        f"points per round over the last {window} rounds, mean over seeds; marked not "
        "converged where the upper end of its 95% interval over seeds lies above "
        f"{100 * CONVERGED_SLOPE:.1f} (a point per 10 rounds: run more rounds), and not judged "
        "with one seed. Versus the reference: the paired "
        "difference per seed, its mean and 95% interval; not worse: the interval lies at or "
        f"above {margin:+.1f} (`--margin`); better: it lies above 0.\n",
        *([f"**{len(seeds)} seed{'s' if len(seeds) > 1 else ''} only**: with fewer than "
           f"{FEW_SEEDS} the 95% intervals are too wide to tell methods apart (with 2, "
           "Student's t is 12.7 standard errors wide); run 5 seeds before you conclude.\n"]
          if len(seeds) < FEW_SEEDS else []),
        *([f"**Unequal tuning budgets** ({', '.join(f'{k} {n}' for k, n in budget.items())} "
           "configurations): the rows with more are favoured; give every row the same "
           "number for a fair comparison.\n"] if len(set(budget.values())) > 1 else []),
        f"| row | configuration (of searched) | seeds | accuracy | min client | slope "
        f"(points/round) | uplink MB | seconds | vs {reference} | not worse | better |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, row in summary["rows"].items():
        versus = row.get("versus_reference")
        verdicts = row.get("verdicts", {})
        if label == reference:
            diff = "reference"
        elif versus is None:
            diff = "no common seed" if reference in summary["rows"] else "-"
        else:
            diff = points(versus)
        lines.append(
            f"| {label} | {config_tag(row['chosen'])} ({budget.get(label, 1)}) | "
            f"{len(row['seeds'])} | "
            f"{100 * row['accuracy'][0]:.1f} ± {100 * row['accuracy'][1]:.1f} | "
            f"{100 * row['accuracy_min'][0]:.1f} | {100 * row['slope'][0]:+.2f}"
            f"{_convergence(row)} | "
            f"{row['mb_up'][0]:.2f} | {row['seconds'][0]:.0f} | {diff} | "
            f"{verdicts.get('verdict', '-')} | {verdicts.get('superiority', '-')} |")
    if summary["failed"]:
        lines += ["\n## Failed runs\n", *(f"- {f}" for f in summary["failed"])]
    lines += ["\n![accuracy per round](accuracy.png)\n",
              "![accuracy against uplink](accuracy-vs-uplink.png)\n"]
    return "\n".join(lines) + "\n"


def _convergence(row: dict[str, Any]) -> str:
    """The slope cell's mark where the row's curves may still be rising."""
    if row["converged"]:
        return ""
    return " (one seed: not judged)" if row["slope_ci95"] is None else " (not converged)"


def plot(summary: dict[str, Any], out: Path) -> None:
    """accuracy.png: each row's curve (mean over seeds, band: min..max); and
    accuracy-vs-uplink.png: each row's accuracy (± std) against its uplink."""
    curves = {}
    for label, row in summary["rows"].items():
        # the rounds every seed evaluated (a round whose evaluations were all dropped is
        # missing from its seed's curve)
        common = sorted(set.intersection(*(set(r) for r in row["rounds"].values())))
        curves[label] = (common, [[dict(zip(row["rounds"][s], c, strict=True))[r]
                                   for r in common] for s, c in row["curves"].items()])
    fig, (ax,) = figure(7, 4.5)
    draw_curves(ax, curves)
    ax.legend(fontsize=7)
    save(fig, out / "accuracy.png")
    fig, (ax,) = figure(6, 4.5)
    draw_accuracy_vs_uplink(ax, {label: (row["mb_up"][0], *row["accuracy"])
                                 for label, row in summary["rows"].items()})
    ax.legend(fontsize=7)
    save(fig, out / "accuracy-vs-uplink.png")


def write_report(summary: dict[str, Any], out: Path, command: str) -> str:
    text = report_markdown(summary, command)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(text)
    if summary["rows"]:
        plot(summary, out)
    return text
