"""report.md and its plots, written from the stored cells (summary.json: ``summary.py``)."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.claims import claim_line, claims
from bench.evidence.pick import pick_lines, picks
from bench.evidence.privacy import privacy_plots, privacy_stats, privacy_summary, privacy_tables
from bench.evidence.protocol import POOL_SIZE, SCENARIOS, cells_folder
from bench.evidence.stats import (
    ablation_stats,
    flag,
    report_seeds_stats,
    row_stats,
    uplink_per_round,
)
from bench.evidence.summary import lr_at_grid_end, searched_rates, summary, thinned
from bench.report import produced_by
from comparison.plots import draw_accuracy_vs_uplink, draw_curves, figure, save
from comparison.stats import CONVERGED_SLOPE, accuracy_difference, config_tag, points, seeds_named

__all__ = ["lr_at_grid_end", "thinned", "write_report"]

# Where a method here differs from its paper in a way that could move one of its verdicts;
# each page's "Deviations" section has the whole list.
DEVIATIONS = [
    ("FedDecomp", "feddecomp", "a conv's factors have this project's shape (its rank counted "
     "on min(I, O) * K), not the authors' int(ratio * O) * K rows; their scale is followed"),
    ("FedDecomp", "feddecomp", "sigma is averaged over the clients that replied, not over all "
     "clients as the authors' code does (cross-device only)"),
    ("Factorized-FL", "factorized-fl", "mu starts at zeros as the paper says; the authors' "
     "code's Xavier start is searched"),
    ("Factorized-FL", "factorized-fl", "absent clients count through their latest upload; "
     "the paper averages over the round's clients (cross-device only)"),
    ("pFedC", "pfedc", "eq. 7 counts absent holders through their latest branches "
     "(cross-device only)"),
    ("pFedC", "pfedc", "a branch's loss is averaged over the batch, eq. 3 divides it by its "
     "number of classes (matters where MGDA-UB is off)"),
    ("FedFac", "fedfac", "its static mode is a row of its own beside the dynamic one the "
     "paper's later version recommends; the random split is of the estimate's size"),
]


def deviations() -> str:
    return "\n".join(f"- {name}: {text} ([details](../../docs/methods/{page}.md))"
                      for name, page, text in DEVIATIONS)


def seeds_column(result: dict[str, Any]) -> str:
    """A table's seeds column for a row or an ablation: how many finished, and the seeds it
    diverged on (a row's: the seeds that collapsed too)."""
    diverged = result["diverged_seeds"]
    collapsed = [s for s in result.get("unstable_seeds", []) if s not in diverged]
    return (str(result["seeds"]) + (f", diverged on {seeds_named(diverged)}" if diverged else "")
            + (f", collapsed on {seeds_named(collapsed)}" if collapsed else ""))


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | chosen configuration (of searched) | seeds, unstable | acc, last 5 rounds "
             "(mean ± std) | without unstable seeds | at base rounds | task acc | min client | "
             "slope (points/round) | uplink MB (total, a round) | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        config = (f"{r['config']} ({len(r['grid'])})" if r["tuned"]
                  else f"{r['config']} (not tuned yet)")
        task = f"{r['accuracy_task'][0]:.4f}" if "accuracy_task" in r else "-"
        slope = f"{100 * r['slope'][0]:+.2f}" + (" ⚑" if flag(r) else "")
        stable = ("-" if not r["unstable_seeds"] else "none" if r["accuracy_stable"] is None
                  else f"{r['accuracy_stable'][0]:.4f}")
        base = (f"{r['at_base']['accuracy'][0]:.4f} ({r['at_base']['rounds']})"
                if "at_base" in r else "-")
        lines.append(f"| {r['label']} | {config} | {seeds_column(r)} | "
                     f"{r['accuracy'][0]:.4f} ± {r['accuracy'][1]:.4f} | {stable} | {base} | "
                     f"{task} | {r['accuracy_min'][0]:.4f} | {slope} | "
                     f"{r['mb_up'][0]:.2f}, {uplink_per_round(r):.3f} | "
                     f"{r['seconds'][0]:.0f} |")
    return "\n".join(lines) + "\n"


def ablation_table(ablated: dict[tuple[str, str, str], dict[str, Any]],
                   redundant: list[protocol.Ablation]) -> str:
    """Each ablation against its row, both on the report seeds: the paired difference and its
    95% interval, as a claim is judged; and those not run because the row's tuned
    configuration already has their change."""
    lines = ["| row | change | question | seeds | acc, last 5 rounds (mean ± std) | min client | "
             "row's acc | difference (points) [95% interval] |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {a.scenario}/{a.label} | {config_tag(a.change)} | {a.question} | - | not run: "
              "the row's tuned configuration already has this change | | | |"
              for a in redundant]
    for result in ablated.values():
        ablation, row = result["ablation"], result["row"]
        seeds = seeds_column(result)
        if result["accuracy"] is None:
            figures = "diverged on every seed |"
        else:
            mean, std = result["accuracy"]
            figures = f"{mean:.4f} ± {std:.4f} | {result['accuracy_min'][0]:.4f}"
        difference = accuracy_difference(result, row)
        lines.append(
            f"| {ablation.scenario}/{ablation.label} ({row['config']}) | "
            f"{config_tag(ablation.change)} | {ablation.question} | {seeds} | {figures} | "
            f"{row['accuracy'][0]:.4f} | "
            f"{'no common seed' if difference is None else points(difference)} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def common_rounds(cells: list[dict[str, Any]]) -> tuple[list[int], list[list[float]]]:
    """The rounds every one of a row's cells evaluated (cells run at different
    ``evaluate-every`` share every k-th round and the last ten), and each cell's accuracy at
    them."""
    rounds = sorted(set.intersection(*(set(c["rounds"]) for c in cells)))
    curves = [dict(zip(c["rounds"], c["accuracy_per_round"], strict=True)) for c in cells]
    return rounds, [[curve[r] for r in rounds] for curve in curves]


def plots(stats: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[str]:
    """Accuracy per round (mean, band = min..max over seeds), one figure per scenario, and
    accuracy (last 5 rounds) against total uplink MB; returns the files written."""
    written = []
    for scenario, rows in stats.items():
        fig, (ax,) = figure(7, 4.5)
        draw_curves(ax, {label: common_rounds(row["cells"]) for label, row in rows.items()})
        ax.set(title=f"{scenario}: personalized accuracy (weighted)", ylabel="accuracy")
        ax.legend(fontsize=7, ncol=2)
        save(fig, out / "matrix" / f"accuracy-{scenario}.png")
        written.append(f"accuracy-{scenario}.png")
    fig, axes = figure(4.2 * len(stats), 4, columns=len(stats))
    for ax, (scenario, rows) in zip(axes, stats.items(), strict=True):
        # on the report seeds, as rows are ranked: extra seeds ran for some rows only
        draw_accuracy_vs_uplink(ax, {label: (row["mb_up"][0], *report_seeds_stats(row))
                                     for label, row in rows.items()})
        ax.set(title=scenario)
        ax.legend(fontsize=6)
    save(fig, out / "matrix" / "accuracy-vs-uplink.png")
    return [*written, "accuracy-vs-uplink.png"]


def judged(matrix: Matrix) -> tuple[dict[str, dict[str, dict[str, Any]]],
                                    dict[tuple[str, str], dict[str, Any] | None],
                                    dict[tuple[str, str, str], dict[str, Any]],
                                    list[dict[str, Any]]]:
    """From the cells present: the statistics of every row with a report seed that finished,
    by scenario; the other rows by (scenario, label), each None where no report seed ran yet,
    else its ``row_stats`` (every report seed of it diverged); the ablations'; and the claims
    judged on them."""
    stats: dict[str, dict[str, dict[str, Any]]] = {}
    unscored = {}
    for s, scenario in SCENARIOS.items():
        for e in scenario.entries:
            r = row_stats(matrix, s, e)
            if r is not None and r["seeds"]:
                stats.setdefault(s, {})[e.label] = r
            else:
                unscored[(s, e.label)] = r
    ablated = ablation_stats(matrix, stats)
    return stats, unscored, ablated, claims(stats, ablated)


def header(matrix: Matrix, command: str) -> str:
    """The report's opening: the cells it is written from and the protocol."""
    cells = [json.loads(c.read_text())
             for c in sorted((matrix.out / "matrix" / cells_folder(matrix.device)).rglob("*.json"))]
    reused = [c for c in cells if "reused_from" in c]
    commits = collections.Counter(c.get("commit", "not recorded") for c in cells)
    machines = sorted({c.get("machine", "not recorded") for c in cells})
    numerics = collections.Counter(c.get("numerics", "not recorded") for c in cells)
    shared = ", ".join(f"`{k}={v}`" for k, v in matrix.common.items()
                       if k not in ("dataset", "plot"))
    rounds = ", ".join(f"{s} {r}" for s in SCENARIOS if (r := matrix.rounds(s)) is not None)

    def hours(some: list[dict[str, Any]]) -> float:
        return sum(c.get("wall_seconds", 0.0) for c in some) / 3600

    return (
        f"# Evidence matrix, protocol v{protocol.PROTOCOL_VERSION}\n\n```\n{command}\n```\n\n"
        f"Written by `bench/matrix.py` (commit `{produced_by()}`) from the stored cells "
        f"(`matrix/{cells_folder(matrix.device)}/`, one JSON per run: {len(cells)} stored, "
        f"{hours(cells):.1f} h of runs, start-up included, of which {len(reused)} "
        f"({hours(reused):.1f} h) taken over from protocol v3 where their run is unchanged "
        f"(`reused_from`); on {'; '.join(machines) or '-'}; the code that ran them: "
        + ", ".join(f"`{c}` {n}" for c, n in sorted(commits.items())) + "; the CPU and "
        "numerical packages they ran on, which move a run beyond its last bits (`bench/README"
        ".md`, reproducibility): " + ", ".join(f"{m} {n}" for m, n in sorted(numerics.items()))
        + "). "
        f"Protocol: two pools of {POOL_SIZE} Fashion-MNIST training images from the real IDX "
        "files, disjoint: the report pool (drawn with seed 0), which every reported figure "
        "is computed on, and the tuning pool (drawn from the other 55,000), which every "
        f"tuning run reads; for every method {shared} (a scenario sets its own base rounds); "
        "every row of a scenario trains the same local epochs. "
        f"Search on seed {protocol.TUNING_SEED}, the same budget for every row: its defaults "
        f"(the papers' values) at each learning rate of {list(protocol.LR_GRID)}, then, at "
        f"the best one, {protocol.EXTRA_CONFIGS} more configurations: the method's own "
        "settings (`SETTINGS` in `bench/evidence/protocol.py`, each keeping the paper's "
        "mechanism), then the common knobs, which leave a round's computation as it is, "
        f"{protocol.COMMON_KNOBS}; a row whose best rate is an end of those it tried first "
        f"tries the next rate past it ({list(protocol.LR_BELOW)} below, "
        f"{list(protocol.LR_ABOVE)} above), at most {protocol.MAX_LR_STEPS} times, each in "
        "place of one of its further configurations. A tuning run holds "
        f"{protocol.TUNING['validation-fraction']:.0%} of each client's training share out as "
        "its validation split and is scored on it: the configuration with the best mean of "
        "its last 5 rounds of validation accuracy is kept. Rounds: one count a scenario, the "
        "smallest of its base rounds and their doublings (at most "
        f"{protocol.MAX_DOUBLINGS}) at which every row's tuning run at its chosen "
        "configuration had converged on validation (slope over the last 10 rounds at most "
        f"{100 * CONVERGED_SLOPE:+.2f} points a round; `bench/evidence/rounds.py`), fixed "
        f"before any report seed ran ({rounds or 'none fixed yet'}); every row runs them on "
        f"seeds {', '.join(map(str, protocol.REPORT_SEEDS))} of the report pool, and is also "
        "read at the base rounds where they are fewer (the run's prefix). The statistics are "
        "the compare command's (`comparison/stats.py`): personalized accuracy weighted by "
        "test examples, the mean of a run's last 5 rounds, then mean ± std over seeds (never "
        "the best round); task acc: the mean over clients of each client's mean per-class "
        "accuracy (pFedC's figure); min client: the same last-5 mean for the lowest client; "
        "slope: points per round over the last 10 rounds, ⚑ where the report seeds' 95% "
        "interval still rises past the rule (informative: the rounds were fixed before); "
        "unstable: a seed that diverged or collapsed (its last-5 mean below half its best "
        "5-round mean), the row's mean shown without it too; uplink and seconds per run. A "
        "claim is judged on the per-seed paired difference against its reference (the best "
        "candidate on validation): held when its 95% interval lies at or above the margin; "
        "primary claims (`PRIMARY` in `bench/evidence/claims.py`) also with Holm's correction "
        "over their family, every other claim exploratory. Machine-readable: "
        "[`matrix/summary.json`](matrix/summary.json).\n\n")


def write_report(matrix: Matrix, command: str) -> str:
    """report.md, summary.json and the plots, from the cells present."""
    stats, unscored, ablated, judged_claims = judged(matrix)
    out = matrix.out
    parts = [header(matrix, command)]
    every_seed_diverged: dict[str, list[str]] = {}
    for (s, label), r in unscored.items():
        if r is not None:
            every_seed_diverged.setdefault(s, []).append(label)
    picked = picks(stats, every_seed_diverged)
    if picked:
        parts += ["## What to pick\n\nPer scenario at its rounds (every row ran them): run the "
                  "stable row with the best mean; also: the stable rows whose paired 95% "
                  "interval against it lies at or above -1 point; avoid: rows with an unstable "
                  "seed, or whose interval lies below -1 point (uplink a round).\n\n",
                  pick_lines(picked, stats), "\n"]
    parts += ["## Paper claims\n\n", "\n".join(map(claim_line, judged_claims)), "\n\n"]
    parts += ["## Deviations from the papers that could move a verdict\n\n", deviations(),
              "\n\n"]
    flagged = [f"- {s}/{label}: {flag(r)}" for s, rows in stats.items()
               for label, r in rows.items() if flag(r)]
    if flagged:
        parts += ["## Rows still rising at their rounds\n\nA claim on such a row rests on a "
                  "figure that may still move.\n\n", "\n".join(flagged), "\n\n"]
    at_end = [f"- {s}/{label}: lr {r['chosen']['lr']} of {searched_rates(r)}"
              for s, rows in stats.items() for label, r in rows.items() if lr_at_grid_end(r)]
    if at_end:
        parts += ["## Rows whose learning rate is an end of their search\n\nEven after "
                  f"{protocol.MAX_LR_STEPS} steps past the grid: a wider search could still "
                  "move their figure.\n\n", "\n".join(at_end), "\n\n"]
    ablations = ablation_table(ablated, [a for a in protocol.ABLATIONS if matrix.redundant(a)])
    if ablations:
        parts += ["## Ablations\n\nA row's tuned configuration with one change (a paper "
                  "method's mechanism off among them), at its rounds, on the exploratory seeds "
                  "(all report seeds for FedFac's random split, a claim's reference).\n\n",
                  ablations, "\n"]
    for scenario, rows in stats.items():
        searched_on = SCENARIOS[scenario].searched_on
        parts += [f"## {scenario}\n\n{SCENARIOS[scenario].question}; "
                  f"{matrix.clients(scenario)} clients"
                  + (f"; each row runs the configuration it chose on {searched_on}"
                     if searched_on else "") + ".\n\n", table(list(rows.values())),
                  f"\n![{scenario}](matrix/accuracy-{scenario}.png)\n\n"]
    private = privacy_stats(matrix)
    if private:
        parts += ["## Differential privacy\n\nEach row below at its tuned configuration and "
                  "its scenario's base rounds, on the exploratory seeds, under local DP (each "
                  f"client clips its update to L2 norm {protocol.PRIVACY_CLIP_NORM} and adds "
                  "Gaussian noise of that times the noise multiplier z; `docs/privacy.md`); "
                  "epsilon at the delta shown in `matrix/summary.json`, the most any run of the "
                  "level spent. Without DP: the row's report seeds read at the base rounds."
                  "\n\n", privacy_tables(private), "\n"]
    shaky = [(f"{s}/{label}", r) for s, rows in stats.items() for label, r in rows.items()
             if r["unstable_seeds"]] + [(f"{s}/{label}", r)
                                        for (s, label), r in unscored.items() if r]
    if shaky:
        parts += ["## Rows with an unstable report seed\n\nDiverged (stored as such, no "
                  "accuracy: a claim on the row or against it is not measured) or collapsed "
                  "(kept in its figures and pairs): never picked.\n\n", "\n".join(
                      f"- {name} ({r['config']}, {r['num_rounds']} rounds): "
                      + "; ".join(f"seed {s} {why}" for s, why in r["unstable_why"].items())
                      + (f"; mean {100 * r['accuracy'][0]:.1f} with its collapsed seeds, "
                         + (f"{100 * r['accuracy_stable'][0]:.1f} without"
                            if r["accuracy_stable"] else "none left without")
                         if set(r["unstable_seeds"]) - set(r["diverged_seeds"]) else "")
                      for name, r in shaky), "\n\n"]
    missing = [f"{s}/{label}" for (s, label), r in unscored.items() if r is None]
    if missing:
        parts.append("## Not run yet\n\n" + ", ".join(missing) + "\n\n")
    (out / "matrix").mkdir(parents=True, exist_ok=True)
    if private:
        privacy_plots(private, out)
    if stats:
        plots(stats, out)
        parts.append("![accuracy against uplink](matrix/accuracy-vs-uplink.png)\n")
    (out / "matrix" / "summary.json").write_text(json.dumps(
        {**summary(matrix, stats, judged_claims, picked),
         **({"privacy": privacy_summary(private)} if private else {})}, indent=1) + "\n")
    text = "".join(parts)
    (out / "report.md").write_text(text)
    return text
