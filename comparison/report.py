"""What ``scripts/compare.sh`` writes (``launch/compare.py``): ``report.md``, ``summary.json``
and two plots, from the summary of ``comparison/stats.py``'s statistics."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from comparison.multiplicity import ALPHA, BUT_UNSTABLE
from comparison.plots import draw_accuracy_vs_uplink, draw_curves, figure, save
from comparison.stats import (
    COLLAPSED_SHARE,
    CONVERGED_SLOPE,
    LAST_ROUNDS,
    SLOPE_ROUNDS,
    config_tag,
    figure_rounds,
    full_window_rounds,
    points,
    run_figures,
    run_window,
)
from comparison.table import (
    MIN_CLIENT,
    SECONDS,
    WITHOUT_UNSTABLE,
    Column,
    Row,
    accuracy_column,
    markdown_table,
    seeds_column,
    slope_column,
    uplink_column,
)

FEW_SEEDS = 3  # below this, a 95% interval over seeds is too wide to tell anything apart
# compare reads a run on its last rounds, none in the first quarter of its rounds
# (comparison.stats.figure_rounds): a short run's first rounds would pull every method down
# summary.json's and each run record's units: fractions where the report and the printed lines
# write points (x 100)
UNITS = {"accuracy": "fraction (0-1): every accuracy, curve, per-seed figure, paired "
                     "difference, interval and margin in this file; report.md and the printed "
                     "lines write points (percent, x 100)",
         "slope": "fraction per round (report.md: points per round)",
         "mb_up": "MB (1024**2 bytes), total sent by the clients",
         "seconds": "seconds, the rounds' wall time",
         "window": "round numbers: the evaluated rounds a run's figures are the mean of"}


def window_text(rounds: Sequence[int]) -> str:
    """Rounds as a line of a report names them: ``round 2``, ``rounds 6-10``, or each of
    them where one is missing (``rounds 5, 7, 8``)."""
    if len(rounds) == 1:
        return f"round {rounds[0]}"
    if list(rounds) == list(range(rounds[0], rounds[-1] + 1)):
        return f"rounds {rounds[0]}-{rounds[-1]}"
    return f"rounds {', '.join(map(str, rounds))}"


def short_runs_warning(run_lengths: Iterable[int]) -> str | None:
    """What a comparison of runs this many rounds long says once, where some are too short
    for a full window of ``LAST_ROUNDS`` rounds; None where none is."""
    short = sorted({n for n in run_lengths
                    if len(figure_rounds(range(1, n + 1))) < LAST_ROUNDS})
    if not short:
        return None
    read = []
    for n in short:
        window = figure_rounds(range(1, n + 1))
        read.append(f"{window_text(window)} ({len(window)} of its {n}"
                    f"{', nothing else is left' if n == 1 else ''})")
    return (f"a run of {short[0]} round{'s' * (short[0] > 1)} is read on {read[0]}"
            + "".join(f", one of {n} rounds on {text}" for n, text in zip(short[1:], read[1:],
                                                                          strict=True))
            + f": a run's figures are the mean of its last {LAST_ROUNDS} evaluated rounds, "
            "none in the first quarter of its rounds, so a short run is read on fewer; run "
            f"{full_window_rounds()} rounds or more for all {LAST_ROUNDS}")


def run_text(summary: Mapping[str, Any]) -> str:
    """A completed run's figures as the report reads them (the same rounds, in points): the
    line ``scripts/compare.sh`` prints as the run ends."""
    figures = run_figures(summary)
    split = "validation " if summary.get("evaluated_on") == "validation" else ""
    return (f"{split}accuracy {100 * figures['accuracy']:.1f}, min client "
            f"{100 * figures['accuracy_min']:.1f} (points, mean of "
            f"{window_text(run_window(summary))})")


def _windows(summary: dict[str, Any]) -> tuple[str, list[int]]:
    """The rounds the runs' figures are the mean of, as the report's header names them (per
    row where they differ), and the runs' lengths (their last evaluated round)."""
    rows: dict[str, list[str]] = {}
    lengths = []
    for label, row in summary["rows"].items():
        for rounds in row["rounds"].values():
            text = window_text(figure_rounds(rounds))
            if label not in rows.setdefault(text, []):
                rows[text].append(label)
            lengths.append(rounds[-1])
    if len(rows) <= 1:
        return next(iter(rows), f"the last {LAST_ROUNDS} rounds"), lengths
    return ", ".join(f"{text} ({', '.join(labels)})" for text, labels in rows.items()), lengths


def report_markdown(summary: dict[str, Any], command: str) -> str:
    """The report: every accuracy and difference in points (percent), the slope over the
    rounds it was computed on, a warning where too few seeds make the intervals
    uninformative."""
    protocol = summary["protocol"]
    margin = 100 * protocol["margin"]
    budget = protocol["budgets"]
    seeds = protocol["seeds"]
    rounds = max((len(c) for row in summary["rows"].values() for c in row["curves"].values()),
                 default=0)
    window = min(SLOPE_ROUNDS, rounds)
    averaged, lengths = _windows(summary)
    short = short_runs_warning(lengths)
    clients = protocol.get("clients")  # none in a summary written before it was recorded
    opening = (f"{clients} client{'s' * (clients > 1)} (`--supernodes`: the data is split "
               f"into {clients} partition{'s' * (clients > 1)}, one per client); seeds "
               if clients else "Seeds ")
    lines = [
        "# Comparison\n", f"```\n{command}\n```\n",
        f"{opening}{', '.join(map(str, seeds))}; a row with a grid was tuned on seed "
        f"{protocol['tuning_seed']}, each configuration scored on validation splits "
        f"({protocol['validation_fraction']:.0%} of every client's training share; never a "
        "test split), and the one with the best mean validation accuracy over the same "
        "rounds as below kept. Every figure is in accuracy points (percent; summary.json "
        "holds fractions). Accuracy: personalized, weighted by test examples, mean of "
        f"{averaged} (a run's last {LAST_ROUNDS} evaluated rounds, none in the first quarter "
        "of its rounds), then mean ± standard deviation over "
        "seeds (never the best round). Min client: the same for the lowest client. Slope: "
        f"points per round over the last {window} rounds, mean over seeds; marked not "
        "converged where the upper end of its 95% interval over seeds lies above "
        f"{100 * CONVERGED_SLOPE:.1f} (a point per 10 rounds: run more rounds), and not judged "
        "with one seed. Versus the reference: the paired "
        "difference per seed, its mean and 95% interval; not worse: the interval lies at or "
        f"above {margin:+.1f} (`--margin`); better: it lies above 0. {_rules(summary)}\n",
        *([f"**Short runs**: {short}.\n"] if short else []),
        *([f"**{len(seeds)} seed{'s' if len(seeds) > 1 else ''} only**: with fewer than "
           f"{FEW_SEEDS} the 95% intervals are too wide to tell methods apart (with 2, "
           "Student's t is 12.7 standard errors wide); run 5 seeds before you conclude.\n"]
          if len(seeds) < FEW_SEEDS else []),
        *([f"**Unequal tuning budgets** ({', '.join(f'{k} {n}' for k, n in budget.items())} "
           "configurations): the rows with more are favoured; give every row the same "
           "number for a fair comparison.\n"] if len(set(budget.values())) > 1 else [])]
    lines.append(markdown_table(_columns(summary), ({"label": label, **row} for label, row
                                                    in summary["rows"].items())).rstrip("\n"))
    if summary["failed"]:
        lines += ["\n## Failed runs\n", *(f"- {f}" for f in summary["failed"])]
    lines += ["\n![accuracy per round](accuracy.png)\n",
              "![accuracy against uplink](accuracy-vs-uplink.png)\n"]
    return "\n".join(lines) + "\n"


def _rules(summary: dict[str, Any]) -> str:
    """The opening paragraph's sentences on unstable seeds and on the primary family."""
    protocol = summary["protocol"]
    family = protocol.get("primary")  # none in a summary written before it was recorded
    holm = (f"The primary family (`--primary`): {', '.join(family) or 'none'}, judged "
            "together with Holm's step-down correction (ordered by p-value, the k-th of m is "
            f"tested at one-sided {100 * ALPHA:.1f}%/(m - k + 1), stopping at the first that "
            "does not hold, so that the chance any of them is called not worse falsely stays "
            f"at most {100 * ALPHA:.1f}%); the other rows are exploratory, their verdicts "
            "unadjusted. " if family is not None else "")
    return (f"{holm}Unstable seed: a report seed that diverged, or collapsed (its figure "
            f"below {COLLAPSED_SHARE:.0%} of its best mean over {LAST_ROUNDS} consecutive "
            "evaluated rounds); its row's seeds name it, its accuracy is shown without it, "
            f"and a verdict that held reads \"{BUT_UNSTABLE}\": never called not worse, "
            "better or tied.")


def _unstable_text(row: Row) -> str:
    """``seed 2 collapsed, seed 3 diverged``: a row's unstable seeds and why."""
    return ", ".join(f"seed {seed} {why.split(':')[0]}"
                     for seed, why in row.get("unstable_why", {}).items())


def _verdict(row: Row, verdict: str) -> str:
    """A verdict cell: one that held on a row with an unstable seed names those seeds."""
    return f"{verdict}: {_unstable_text(row)}" if verdict == BUT_UNSTABLE else verdict


def _adjusted(row: Row) -> str:
    """The Holm column: a primary row's adjusted interval and verdict, else what it is."""
    if not row.get("primary"):
        return "exploratory" if "verdicts" in row else "-"
    if row.get("ci95_adjusted") is None:
        return row.get("verdict_adjusted", "-")
    low, high = row["ci95_adjusted"]
    return f"[{100 * low:+.1f}, {100 * high:+.1f}] {_verdict(row, row['verdict_adjusted'])}"


def _columns(summary: dict[str, Any]) -> list[Column]:
    """The report's table: the shared statistics, then each row against the reference."""
    protocol = summary["protocol"]
    reference, budget = protocol["reference"], protocol["budgets"]

    def versus(row: Row) -> str:
        if row["label"] == reference:
            return "reference"
        if row.get("versus_reference") is None:
            return "no common seed" if reference in summary["rows"] else "-"
        return points(row["versus_reference"])

    return [Column("row", lambda row: row["label"]),
            Column("configuration (of searched)",
                   lambda row: f"{config_tag(row['chosen'])} ({budget.get(row['label'], 1)})"),
            Column("seeds", lambda row: seeds_column(
                {"seeds": len(row["seeds"]), "diverged_seeds": row.get("diverged_seeds", []),
                 "unstable_seeds": row.get("unstable_seeds", [])})),
            accuracy_column(), WITHOUT_UNSTABLE, MIN_CLIENT, slope_column(_convergence),
            uplink_column(), SECONDS,
            Column(f"vs {reference} (points, 95% interval)", versus),
            Column("not worse", lambda row: _verdict(row, row.get("verdicts", {})
                                                     .get("verdict", "-"))),
            Column("better", lambda row: _verdict(row, row.get("verdicts", {})
                                                  .get("superiority", "-"))),
            Column("not worse, Holm-adjusted", _adjusted)]


def _convergence(row: Row) -> str:
    """The slope cell's mark where the row's curves may still be rising."""
    if row["converged"]:
        return ""
    return " (one seed: not judged)" if row["slope_ci95"] is None else " (not converged)"


def plot(summary: dict[str, Any], out: Path) -> None:
    """accuracy.png: each row's curve (mean over seeds, band: min..max); and
    accuracy-vs-uplink.png: each row's accuracy (± std) against its uplink; in points, as
    the report."""
    curves = {}
    for label, row in summary["rows"].items():
        # the rounds every seed evaluated (a round whose evaluations were all dropped is
        # missing from its seed's curve)
        common = sorted(set.intersection(*(set(r) for r in row["rounds"].values())))
        curves[label] = (common, [[100 * dict(zip(row["rounds"][s], c, strict=True))[r]
                                   for r in common] for s, c in row["curves"].items()])
    fig, (ax,) = figure(7, 4.5)
    draw_curves(ax, curves)
    ax.set(ylabel="personalized accuracy (points, weighted)")
    ax.legend(fontsize=7)
    save(fig, out / "accuracy.png")
    fig, (ax,) = figure(6, 4.5)
    draw_accuracy_vs_uplink(ax, {label: (row["mb_up"][0], 100 * row["accuracy"][0],
                                         100 * row["accuracy"][1])
                                 for label, row in summary["rows"].items()})
    ax.set(ylabel=f"accuracy (points, mean of {_windows(summary)[0]})")
    ax.legend(fontsize=7)
    save(fig, out / "accuracy-vs-uplink.png")


def write_report(summary: dict[str, Any], out: Path, command: str) -> str:
    """report.md, summary.json (fractions, its ``units`` say so) and the plots under
    ``out``; the report's text."""
    text = report_markdown(summary, command)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "report.md").write_text(text)
    if summary["rows"]:
        plot(summary, out)
    return text
