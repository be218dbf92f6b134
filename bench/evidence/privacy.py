"""The privacy-utility evidence (``protocol.PRIVACY``), from the stored cells: each row's
accuracy under local DP at each noise multiplier, the epsilon it spent, and paired intervals
against FedAvg and FedPer at the same noise multiplier and against the row itself without DP.
The same noise multiplier is the same epsilon where every client takes part in every round
(Dirichlet 0.1); on cross-device a client's epsilon grows with its draws, which differ from
run to run, and a level reports the most any of its runs spent. A seed that diverged has no
accuracy: a difference is over the seeds both sides have, and says so when they are fewer
than the report seeds; a side whose every seed diverged is named in the tables, and marked x
on the plot's floor. A run that diverged stops early (three rounds of nothing but non-finite
replies) and spends less: a level's epsilon, in a table's header and on the plot, is the most
any row's run spent at it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from comparison.plots import figure, row_style, save
from comparison.stats import accuracy_difference, by_seed_finished, method_stats, points
from comparison.table import Column, markdown_table, mean_std_points

Level = dict[str, Any]


def privacy_stats(matrix: Matrix) -> dict[str, dict[str, dict[str, Any]]]:
    """scenario -> row -> ``{"none": stats without DP, "levels": {z: stats under DP}}``, each
    as ``comparison.stats.method_stats`` gives it; a level also holds the most epsilon any of
    its runs spent (every run's guarantee), its delta, and its seeds that diverged (their
    losses stopped being finite: no accuracy)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for entry in protocol.PRIVACY:
        cells, clean = matrix.privacy(entry, may_run=False)
        if not cells:
            continue
        private, diverged = by_seed_finished(cells)
        spent = [c["privacy"] for c in cells if "privacy" in c]  # diverged ones spent it too
        row = out.setdefault(entry.scenario, {}).setdefault(entry.label, {"levels": {}})
        finished = by_seed_finished(clean)[0]
        if finished and "none" not in row:  # the same cells for every level
            row["none"] = method_stats(finished)
        row["levels"][entry.change["dp.noise-multiplier"]] = {
            **(method_stats(private) if private else {}),
            "epsilon": max((p["epsilon"] for p in spent), default=None),
            "delta": spent[0]["delta"] if spent else None,
            "diverged": diverged}
    return out


def differences(rows: dict[str, dict[str, Any]], label: str, z: float
                ) -> dict[str, dict[str, Any] | None]:
    """A row at noise multiplier ``z`` against each reference at ``z`` and against itself
    without DP: paired over seeds (``comparison.stats.accuracy_difference``)."""
    level = rows[label]["levels"][z]
    if "per_seed" not in level:
        return {}
    out: dict[str, dict[str, Any] | None] = {
        reference: accuracy_difference(level, rows[reference]["levels"][z])
        for reference in protocol.PRIVACY_REFERENCES
        if reference != label and reference in rows
        and "per_seed" in rows[reference]["levels"].get(z, {})}
    if "none" in rows[label]:
        out["no DP"] = accuracy_difference(level, rows[label]["none"])
    return out


def all_diverged(level: Level) -> bool:
    """Whether every seed of ``level`` diverged: it has seeds, none with an accuracy."""
    return "accuracy" not in level and bool(level.get("diverged"))


def _figure(level: Level) -> str:
    if "accuracy" not in level:
        return "diverged" if all_diverged(level) else "-"
    diverged = f", {len(level['diverged'])} diverged" if level.get("diverged") else ""
    return mean_std_points(level["accuracy"]) + diverged


def _difference(difference: dict[str, Any] | None) -> str:
    if difference is None:
        return "-"
    fewer = len(difference["seeds"]) < len(protocol.REPORT_SEEDS)
    seeds = ", ".join(map(str, difference["seeds"]))
    return points(difference) + (f" (seeds {seeds} only)" if fewer else "")


def _undefined(rows: dict[str, dict[str, Any]], label: str, name: str, z: float) -> str:
    """Why a paired difference has no value: a side whose every seed diverged, or none
    measured (``-``)."""
    if name == label:
        return "-"
    if all_diverged(rows[label]["levels"][z]):
        return "diverged"
    if name != "no DP" and all_diverged(rows.get(name, {}).get("levels", {}).get(z, {})):
        return f"{name} diverged"
    return "-"


def level_epsilons(rows: dict[str, dict[str, Any]]) -> dict[float, float | None]:
    """Noise multiplier -> the most epsilon any row's run spent at it (None: not recorded)."""
    levels = sorted({z for row in rows.values() for z in row["levels"]})
    return {z: max((row["levels"][z]["epsilon"] for row in rows.values()
                    if row["levels"].get(z, {}).get("epsilon") is not None), default=None)
            for z in levels}


def privacy_tables(stats: dict[str, dict[str, dict[str, Any]]]) -> str:
    """Per scenario: accuracy (mean ± std over seeds, last 5 rounds) per row and noise
    multiplier, then every paired difference with its 95% interval."""
    parts = []
    for scenario, rows in stats.items():
        spent = level_epsilons(rows)
        levels = list(spent)
        named = [{"label": label, **row} for label, row in rows.items()]
        figures = [Column("row", lambda row: row["label"]),
                   Column("no DP", lambda row: _figure(row["none"]) if "none" in row else "-")]
        figures += [Column(f"z = {z} (ε ≤ {epsilon:.3g})" if epsilon is not None
                           else f"z = {z} (ε not recorded)",
                           lambda row, z=z: _figure(row["levels"].get(z, {})))
                    for z, epsilon in spent.items()]
        references = (*protocol.PRIVACY_REFERENCES, "no DP")
        paired = []  # a row at a noise multiplier: each difference's cell
        for row in named:
            for z in (z for z in levels if z in row["levels"]):
                found = differences(rows, row["label"], z)
                paired.append({"label": row["label"], "z": z, **{
                    name: _difference(found[name]) if found.get(name) is not None
                    else _undefined(rows, row["label"], name, z) for name in references}})
        versus = [Column(f"vs {name}" if name != "no DP" else "vs itself without DP",
                         lambda pair, name=name: pair[name]) for name in references]

        lines = [f"### {scenario}\n", markdown_table(figures, named),
                 "Paired differences in accuracy points [95% interval], at the same noise "
                 "multiplier, over the seeds both sides have:\n",
                 markdown_table([Column("row", lambda pair: pair["label"]),
                                 Column("z", lambda pair: str(pair["z"])),
                                 *versus],
                                paired).rstrip("\n")]
        parts.append("\n".join(lines) + f"\n\n![{scenario}](matrix/privacy-{scenario}.png)\n")
    return "\n".join(parts)


def privacy_plots(stats: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[str]:
    """Accuracy (mean ± std over seeds) against the epsilon spent, one line per row through
    its noise multipliers, its accuracy without DP a dotted line; one figure per scenario."""
    written = []
    for scenario, rows in stats.items():
        fig, (ax,) = figure(7, 4.5)
        for index, (label, row) in enumerate(rows.items()):
            style = row_style(index)
            measured = sorted((level["epsilon"], *(100 * v for v in level["accuracy"][:2]))
                             for level in row["levels"].values()
                             if "accuracy" in level and level.get("epsilon"))
            if measured:
                epsilons, means, stds = zip(*measured, strict=True)
                ax.errorbar(epsilons, means, yerr=stds, label=label, color=style["color"],
                            linestyle=style["linestyle"], marker=style["marker"], capsize=2)
            if "none" in row:
                ax.axhline(100 * row["none"]["accuracy"][0], color=style["color"], linestyle=":",
                           linewidth=0.8)
        bottom = ax.get_ylim()[0]  # a level whose every seed diverged: an x on the floor
        spent = level_epsilons(rows)
        for index, row in enumerate(rows.values()):
            lost = [spent[z] for z, level in row["levels"].items()
                    if all_diverged(level) and spent[z]]
            if lost:
                ax.scatter(lost, [bottom] * len(lost), marker="x", clip_on=False,
                           color=row_style(index)["color"])
        ax.set_ylim(bottom=bottom)
        ax.set(xscale="log", xlabel="epsilon spent (log; local DP)",
               ylabel="personalized accuracy (points, last 5 rounds)",
               title=f"{scenario}: accuracy under DP (dotted: without DP; x: diverged)")
        ax.legend(fontsize=7)
        save(fig, out / "matrix" / f"privacy-{scenario}.png")
        written.append(f"privacy-{scenario}.png")
    return written


def privacy_summary(stats: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """``summary.json``'s ``privacy``: the protocol and every row's figures (fractions)."""
    def level_entry(rows: dict[str, Any], label: str, z: float) -> dict[str, Any]:
        level = rows[label]["levels"][z]
        return {"epsilon": level.get("epsilon"), "delta": level.get("delta"),
                "diverged_seeds": level.get("diverged", []),
                **({"mean": level["accuracy"][0], "std": level["accuracy"][1],
                    "per_seed": {str(s): f["accuracy"] for s, f in level["per_seed"].items()}}
                   if "accuracy" in level else {}),
                "vs": {name: (None if d is None else
                              {"mean_diff": d["mean_diff"], "ci95": d["ci95"],
                               "paired_diffs": d["paired_diffs"]})
                       for name, d in differences(rows, label, z).items()}}

    return {"mode": "local", "clip_norm": protocol.PRIVACY_CLIP_NORM,
            "noise_multipliers": list(protocol.NOISE_MULTIPLIERS),
            "references": list(protocol.PRIVACY_REFERENCES),
            "rows": {f"{scenario}/{label}": {
                **({"none": {"mean": row["none"]["accuracy"][0],
                             "std": row["none"]["accuracy"][1]}} if "none" in row else {}),
                "levels": {str(z): level_entry(rows, label, z) for z in sorted(row["levels"])}}
                for scenario, rows in stats.items() for label, row in rows.items()}}
