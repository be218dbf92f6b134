"""report.md and its plots, written from the stored cells."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import numpy as np

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.claims import claims
from bench.evidence.protocol import (
    COMMON,
    POOL_SIZE,
    SCENARIOS,
)
from bench.evidence.stats import ablation_stats, row_stats
from bench.report import produced_by
from launch.comparison import config_tag


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | configuration | seeds | acc, last 5 rounds (mean ± std) | min client | "
             "slope (points/round) | uplink MB (total) | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        config = r["config"] + ("" if r["tuned"] else " (not tuned yet)")
        lines.append(f"| {r['label']} | {config} | {r['seeds']} | "
                     f"{r['accuracy'][0]:.4f} ± {r['accuracy'][1]:.4f} | "
                     f"{r['accuracy_min'][0]:.4f} | {100 * r['slope'][0]:+.2f} | "
                     f"{r['mb_up'][0]:.2f} | {r['seconds'][0]:.0f} |")
    return "\n".join(lines) + "\n"


def ablation_table(ablated: dict[tuple[str, str, str], dict[str, Any]]) -> str:
    """Each ablation against its row, both on the report seeds."""
    lines = ["| row | change | question | seeds | acc, last 5 rounds (mean ± std) | min client | "
             "row's acc | difference (points) |", "|---|---|---|---|---|---|---|---|"]
    for result in ablated.values():
        ablation, row = result["ablation"], result["row"]
        mean, std = result["accuracy"]
        lines.append(
            f"| {ablation.scenario}/{ablation.label} ({row['config']}) | "
            f"{config_tag(ablation.change)} | {ablation.question} | {result['seeds']} | "
            f"{mean:.4f} ± {std:.4f} | {result['accuracy_min'][0]:.4f} | "
            f"{row['accuracy'][0]:.4f} | {100 * (mean - row['accuracy'][0]):+.1f} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def plots(stats: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[str]:
    """Accuracy per round (mean, band = min..max over seeds), one figure per scenario, and
    accuracy (last 5 rounds) against total uplink MB; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for scenario, rows in stats.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, row in rows.items():
            curves = np.array([c["accuracy_per_round"] for c in row["cells"]])
            x = row["cells"][0]["rounds"]
            ax.plot(x, curves.mean(0), label=label)
            ax.fill_between(x, curves.min(0), curves.max(0), alpha=0.15)
        ax.set(title=f"{scenario}: personalized accuracy (weighted)", xlabel="round",
               ylabel="accuracy")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(out / "matrix" / f"accuracy-{scenario}.png", dpi=110)
        plt.close(fig)
        written.append(f"accuracy-{scenario}.png")
    fig, axes = plt.subplots(1, len(stats), figsize=(4.2 * len(stats), 4), squeeze=False)
    for ax, (scenario, rows) in zip(axes[0], stats.items(), strict=True):
        for label, row in rows.items():
            ax.errorbar(row["mb_up"][0], row["accuracy"][0], yerr=row["accuracy"][1],
                        fmt="o", label=label)
        ax.set(title=scenario, xlabel="uplink MB (total, log)", ylabel="accuracy (last 5 rounds)",
               xscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "matrix" / "accuracy-vs-uplink.png", dpi=110)
    plt.close(fig)
    return [*written, "accuracy-vs-uplink.png"]


def write_report(matrix: Matrix, command: str) -> str:
    stats = {s: {e.label: r for e in entries if (r := row_stats(matrix, s, e)) is not None}
             for s, (_, entries) in SCENARIOS.items()}
    stats = {s: rows for s, rows in stats.items() if rows}
    ablated = ablation_stats(matrix, stats)
    out = matrix.out
    cells = sorted((out / "matrix" / "cells").rglob("*.json"))
    commits = collections.Counter(json.loads(c.read_text()).get("commit", "not recorded")
                                  for c in cells)
    parts = [
        "# Evidence matrix\n\n",
        f"```\n{command}\n```\n\n",
        f"Written by `bench/matrix.py` (commit `{produced_by()}`) from the stored cells "
        f"(`matrix/cells/`, one JSON per run: {len(cells)} stored; the code that ran them: "
        + ", ".join(f"`{c}` {n}" for c, n in sorted(commits.items())) + "). "
        f"Protocol: {POOL_SIZE} Fashion-MNIST training images drawn with "
        f"seed 0 from the real IDX files, {matrix.num_clients} clients, each keeping "
        f"{COMMON['test-fraction']} of its share as its test split; the CNN (an MLP on "
        f"the synthetic data), "
        f"{COMMON['num-server-rounds']} rounds, {COMMON['local-epochs']} local epochs, batch "
        f"{COMMON['batch-size']}, momentum {COMMON['momentum']} for every method. Tuning on "
        f"seed {protocol.TUNING_SEED} (four runs per method: the learning rate, and the main "
        "hyperparameter where a method has one, by final-round accuracy), reported on seeds "
        f"{', '.join(map(str, protocol.REPORT_SEEDS))}. The statistics are the compare "
        "command's (`launch/comparison.py`): personalized accuracy weighted by test "
        "examples, the mean of a run's last 5 rounds, then mean ± std over seeds (never the "
        "best round); min client: the same for the lowest client (its final round where a "
        "cell kept no curve of it); slope: accuracy points per round over the last 10 "
        "rounds; uplink and seconds per run. A row marked *not tuned yet* ran its defaults."
        "\n\n",
        "## Paper claims\n\n", "\n".join(claims(stats, ablated)), "\n\n",
    ]
    ablations = ablation_table(ablated)
    if ablations:
        parts += ["## Ablations\n\nA row's tuned configuration with one change, on the same "
                  "report seeds: why a claim did not hold, or the reference a claim is judged "
                  "against (FedFac's random split of the same size).\n\n", ablations, "\n"]
    for scenario, rows in stats.items():
        parts += [f"## {scenario}\n\n", table(list(rows.values())),
                  f"\n![{scenario}](matrix/accuracy-{scenario}.png)\n\n"]
    missing = [f"{s}/{e.label}" for s, (_, entries) in SCENARIOS.items() for e in entries
               if e.label not in stats.get(s, {})]
    if missing:
        parts.append("## Not run yet\n\n" + ", ".join(missing) + "\n\n")
    if stats:
        plots(stats, out)
        parts.append("![accuracy against uplink](matrix/accuracy-vs-uplink.png)\n")
    text = "".join(parts)
    (out / "matrix").mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    return text
