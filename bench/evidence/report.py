"""report.md and its plots, written from the stored cells: its header here, its sections
(``sections.py``) in their order, ``summary.json`` (``summary.py``) beside it."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.privacy import privacy_plots, privacy_summary
from bench.evidence.protocol import POOL_SIZE, SCENARIOS, cells_folder
from bench.evidence.sections import SECTIONS, judge
from bench.evidence.stats import report_seeds_stats
from bench.evidence.summary import summary
from bench.report import produced_by
from comparison.plots import draw_accuracy_vs_uplink, draw_curves, figure, save
from comparison.stats import CONVERGED_SLOPE


def common_rounds(cells: list[dict[str, Any]]) -> tuple[list[int], list[list[float]]]:
    """The rounds every one of a row's cells evaluated (cells run at different
    ``evaluate-every`` share every k-th round and the last ten), and each cell's accuracy at
    them."""
    rounds = sorted(set.intersection(*(set(c["rounds"]) for c in cells)))
    curves = [dict(zip(c["rounds"], c["accuracy_per_round"], strict=True)) for c in cells]
    return rounds, [[curve[r] for r in rounds] for curve in curves]


def _in_points(rounds: list[int], curves: list[list[float]]
               ) -> tuple[list[int], list[list[float]]]:
    return rounds, [[100 * accuracy for accuracy in curve] for curve in curves]


def plots(stats: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[str]:
    """Accuracy per round (mean, band = min..max over seeds), one figure per scenario, and
    accuracy (last 5 rounds) against total uplink MB, in points as the tables; returns the
    files written."""
    written = []
    for scenario, rows in stats.items():
        fig, (ax,) = figure(7, 4.5)
        draw_curves(ax, {label: _in_points(*common_rounds(row["cells"]))
                         for label, row in rows.items()})
        ax.set(title=f"{scenario}: personalized accuracy (weighted)",
               ylabel="accuracy (points)")
        ax.legend(fontsize=7, ncol=2)
        save(fig, out / "matrix" / f"accuracy-{scenario}.png")
        written.append(f"accuracy-{scenario}.png")
    fig, axes = figure(4.2 * len(stats), 4, columns=len(stats))
    for ax, (scenario, rows) in zip(axes, stats.items(), strict=True):
        # on the report seeds, as rows are ranked: extra seeds ran for some rows only
        draw_accuracy_vs_uplink(ax, {label: (row["mb_up"][0],
                                             *(100 * v for v in report_seeds_stats(row)))
                                     for label, row in rows.items()})
        ax.set(title=scenario)
        ax.legend(fontsize=6)
    save(fig, out / "matrix" / "accuracy-vs-uplink.png")
    return [*written, "accuracy-vs-uplink.png"]


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
    evidence = judge(matrix)
    text = header(matrix, command) + "".join(section(evidence) for section in SECTIONS)
    (matrix.out / "matrix").mkdir(parents=True, exist_ok=True)
    if evidence.private:
        privacy_plots(evidence.private, matrix.out)
    if evidence.stats:
        plots(evidence.stats, matrix.out)
        text += "![accuracy against uplink](matrix/accuracy-vs-uplink.png)\n"
    (matrix.out / "matrix" / "summary.json").write_text(json.dumps(
        {**summary(matrix, evidence.stats, evidence.claims, evidence.picked),
         **({"privacy": privacy_summary(evidence.private)} if evidence.private else {})},
        indent=1) + "\n")
    (matrix.out / "report.md").write_text(text)
    return text
