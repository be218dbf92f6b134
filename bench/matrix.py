"""The evidence matrix: every method on Fashion-MNIST scenarios, tuned on one seed, reported
on three others, with one report (``bench/results/report.md``) and its plots.

    python bench/matrix.py                        # the whole matrix: tune, then report; resumes
    python bench/matrix.py --stage report --scenarios dirichlet-0.1 --only fedavg,feddecomp
    python bench/matrix.py --ablations            # only the ablations of tuned rows
    python bench/matrix.py --write-only           # rewrite report.md and plots from the cells

Every run is one cell (its summary and per-round series), stored as
``bench/results/matrix/cells/<scenario>/<label>/<stage>-<config>-seed<k>.json``; a cell
that exists is not run again, so the command resumes where it stopped, and the report is
always written from all cells present (plots in ``bench/results/matrix/``). The protocol
(README "Benchmarks"):

- data: ``POOL_SIZE`` images drawn (``numpy`` seed 0) from Fashion-MNIST's 60,000 training
  images in the real IDX files (``bench.data.ensure_dataset``), 20 clients, each keeping
  ``test-fraction`` of its share as its personal test split; same model (the CNN), rounds,
  local epochs, batch size and evaluation for every method (``COMMON``);
- tuning: on seed ``TUNING_SEED`` each method runs every configuration of its grid
  (``tuning_grid``: the learning rate and at most one main hyperparameter, four runs each);
  the configuration with the best final-round personalized accuracy (weighted) is kept;
- report: the kept configuration on seeds ``REPORT_SEEDS``; the table gives the mean and
  standard deviation over seeds of the final round's accuracy (never the best round), the
  lowest client's accuracy, total uplink MB and seconds. A method not tuned yet runs its
  defaults and is marked so;
- ablations (``ABLATIONS``, run after the rows): a row's tuned configuration with one
  change, on the same report seeds: where a claim did not hold, to show why, and FedFac's
  random split of the same size, the reference its split claim is judged against.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.data import ensure_dataset  # noqa: E402
from bench.report import RESULTS, produced_by  # noqa: E402
from bench.run_methods import MB  # noqa: E402
from common.config import app_packages  # noqa: E402
from fldata.sources import idx_pool  # noqa: E402
from launch.federation import LocalFederation  # noqa: E402

POOL_SIZE = 5000       # images drawn from the 60,000 (250 a client: the FedDecomp paper's size)
NUM_CLIENTS = 20
TUNING_SEED = 0
REPORT_SEEDS = (1, 2, 3)
COMMON: dict[str, Any] = {"num-server-rounds": 15, "local-epochs": 2, "batch-size": 32,
                          "momentum": 0.9, "test-fraction": 0.2, "plot": False}
BASELINES = ("fedavg", "fedprox", "local", "fedper", "fedrep", "fedbn", "fedavg-ft")
LEARNING_RATES = (0.01, 0.02, 0.05, 0.1)   # methods without a main hyperparameter
LEARNING_RATES_2 = (0.02, 0.05)             # with one: 2 x 2 runs, the same budget


@dataclass(frozen=True)
class Entry:
    """One row of a scenario: a method, with fixed overrides that make it a variant."""

    label: str
    method: str
    fixed: dict[str, Any] = field(default_factory=dict)


def entry(label: str, **fixed: Any) -> Entry:
    return Entry(label, label.split("@", 1)[0], {k.replace("__", "."): v
                                                 for k, v in fixed.items()})


FEDFAC_STATIC = entry("fedfac")
FEDFAC_DYNAMIC = entry("fedfac@dynamic", fedfac__mode="dynamic")

# Each method on its paper's scenario plus the shared Dirichlet 0.1, baselines everywhere.
SCENARIOS: dict[str, tuple[dict[str, Any], list[Entry]]] = {
    "dirichlet-0.1": ({"partitioner": "dirichlet", "dirichlet-alpha": 0.1},
                      [*map(entry, BASELINES), entry("feddecomp"), FEDFAC_STATIC,
                       FEDFAC_DYNAMIC, entry("pfedc"), entry("factorized-fl")]),
    "pathological-2": ({"partitioner": "pathological", "classes-per-client": 2},
                       [*map(entry, BASELINES), entry("pfedc")]),
    "permuted-labels": ({"partitioner": "iid", "permute-labels": True},
                        [*map(entry, BASELINES), entry("factorized-fl")]),
    "domain-groups": ({"partitioner": "domain", "domain-groups": 2},
                      [*map(entry, BASELINES), entry("factorized-fl")]),
    # FedFac's eq. 8 generator: its estimated split against the true and a random one
    "synthetic-fedfac": ({"dataset": "synthetic-fedfac", "partitioner": "iid"},
                         [entry("fedavg"), entry("local"), FEDFAC_STATIC, FEDFAC_DYNAMIC,
                          entry("fedfac@true-split", fedfac__split="true"),
                          entry("fedfac@random-split", fedfac__split="random")]),
}

# The one main hyperparameter each method is tuned on besides the learning rate.
MAIN_HYPERPARAMETER: dict[str, tuple[str, tuple[Any, ...]]] = {
    "fedprox": ("fedprox.mu", (0.01, 0.1)),
    "fedrep": ("fedrep.head-epochs", (1, 2)),
    "feddecomp": ("feddecomp.rank", (0.25, 0.5)),
    "fedfac": ("fedfac.tau-quantile", (0.3, 0.5)),
    "pfedc": ("pfedc.mgda", (True, False)),
    "factorized-fl": ("factorized-fl.l1", (0.0005, 0.005)),
}


SAME_SIZE_RANDOM_SPLIT = {"fedfac.split": "random"}


@dataclass(frozen=True)
class Ablation:
    """A row's tuned configuration with one change, on the report seeds (``--ablations``): a
    claim that did not hold, probed, or the reference a claim is judged against."""

    scenario: str
    label: str               # the row it varies
    change: dict[str, Any]   # replaces or adds keys of that row's tuned configuration
    question: str


ABLATIONS = [
    Ablation("dirichlet-0.1", "feddecomp", {"feddecomp.rank": 1.0},
             "Is the personal part too small? B A as large as the layer (rank ratio 1)."),
    Ablation("dirichlet-0.1", "feddecomp", {"feddecomp.bn-stats": "personal"},
             "Do averaged BatchNorm statistics cost it? Running statistics kept per client."),
    Ablation("permuted-labels", "factorized-fl", {"factorized-fl.tau": 1.0},
             "The factorized model or the matching? With tau = 1 a client averages only with "
             "matching vectors pointing exactly its way (itself): the model trained locally."),
    Ablation("permuted-labels", "factorized-fl", {"factorized-fl.variant": "u-paper"},
             "The paper's shared set: only u (biases and BatchNorm affine stay personal)."),
    Ablation("permuted-labels", "factorized-fl", {"factorized-fl.l1": 0.0},
             "Does the sparsity penalty on mu cost it? No L1."),
    # The reference FedFac's split claim needs: the row's own tuned configuration (so the
    # same tau-quantile, hence as many shared elements as estimated), the elements drawn at
    # random. The tuned ``fedfac@random-split`` row picks its own tau-quantile, so its split
    # need not have the estimate's size.
    *(Ablation("synthetic-fedfac", label, SAME_SIZE_RANDOM_SPLIT,
               "A random split of the same size: as many shared elements as estimated, "
               "chosen at random, all else the row's.")
      for label in ("fedfac", "fedfac@dynamic")),
]


def expand(config: dict[str, Any]) -> dict[str, Any]:
    """Run-config overrides of a tuning configuration (``feddecomp.rank`` sets both ranks)."""
    out = {k: v for k, v in config.items() if k != "feddecomp.rank"}
    if "feddecomp.rank" in config:  # a rank key given as well wins
        rank = config["feddecomp.rank"]
        out = {"feddecomp.rank-conv": rank, "feddecomp.rank-linear": rank, **out}
    return out


def tuning_grid(method: str) -> list[dict[str, Any]]:
    """The same budget for every method: four configurations."""
    if method not in MAIN_HYPERPARAMETER:
        return [{"lr": lr} for lr in LEARNING_RATES]
    name, values = MAIN_HYPERPARAMETER[method]
    return [{"lr": lr, name: v} for lr, v in itertools.product(LEARNING_RATES_2, values)]


def config_tag(config: dict[str, Any]) -> str:
    """A config as part of a file name. No commas: Flower lists a FAB's files as
    ``path,sha256,bits`` lines, so a comma in any file under the app breaks ``flwr run .``."""
    return "+".join(f"{k}={v}" for k, v in sorted(config.items())) or "defaults"


def cell_path(out: Path, scenario: str, label: str, stage: str, config: dict[str, Any],
              seed: int) -> Path:
    return (out / "matrix" / "cells" / scenario / label.replace("@", "-")
            / f"{stage}-{config_tag(config)}-seed{seed}.json")


def summarize_run(results: dict[str, Any]) -> dict[str, Any]:
    """What a cell keeps of a run's results.json: final numbers and per-round series."""
    rounds = [r for r in results["rounds"] if "eval" in r]
    final = results["final"]
    return {
        "accuracy_weighted": final["accuracy_weighted"],
        "accuracy_mean": final["accuracy_mean"],
        "accuracy_min": final["accuracy_min"],
        "mb_up_total": final["bytes_up_total"] / MB,
        "seconds_total": final["seconds_total"],
        "rounds": [r["round"] for r in rounds],
        "accuracy_per_round": [r["eval"]["accuracy_weighted"] for r in rounds],
        "mb_up_per_round": [r["bytes_up"] / MB for r in results["rounds"]],
    }


def protocol(run_config: dict[str, Any]) -> dict[str, Any]:
    """What a cell's numbers depend on: its run config without where it wrote, with the pool
    named by its file name (the cache folder differs between machines)."""
    return {k: Path(v).name if k == "dataset" and "/" in str(v) else v
            for k, v in run_config.items() if k != "output-dir"}


def pool_file(size: int = POOL_SIZE) -> Path:
    """The subsample of Fashion-MNIST's training images every cell reads, written once."""
    path = Path("~/.cache/pflower/bench").expanduser() / f"fashion-mnist-{size}.npz"
    if not path.exists():
        found = ensure_dataset("fashion-mnist")
        if found is None:
            raise SystemExit(1)
        x, y = idx_pool(found)
        chosen = np.random.default_rng(0).choice(len(y), size, replace=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path.with_suffix(".tmp.npz"), x=x[chosen], y=y[chosen])
        path.with_suffix(".tmp.npz").replace(path)
    return path


class Matrix:
    """The cells under ``out``: stored ones are read, missing ones run on ``federation`` (one
    private SuperLink) when there is one."""

    def __init__(self, federation: LocalFederation | None, common: dict[str, Any],
                 out: Path = RESULTS, num_clients: int = NUM_CLIENTS) -> None:
        self.federation = federation
        self.common = common
        self.out = out
        self.num_clients = num_clients

    def run_config(self, scenario: str, item: Entry, config: dict[str, Any], seed: int,
                   out: Path) -> dict[str, Any]:
        """What one cell runs: the common settings, the scenario's, the row's, the config."""
        scenario_config, _ = SCENARIOS[scenario]
        return {**self.common, **scenario_config, **item.fixed, **expand(config),
                "method": item.method, "seed": seed, "output-dir": str(out)}

    def cell(self, scenario: str, item: Entry, stage: str, config: dict[str, Any],
             seed: int, may_run: bool = True) -> dict[str, Any] | None:
        """The stored cell, if it ran under today's protocol; else run it (``may_run``)."""
        path = cell_path(self.out, scenario, item.label, stage, config, seed)
        cells = self.out / "matrix" / "cells"
        out = self.out / "matrix" / "runs" / path.relative_to(cells).with_suffix("")
        run_config = self.run_config(scenario, item, config, seed, out)
        if path.exists():
            stored = json.loads(path.read_text())
            if (protocol(stored["run_config"]) == protocol(run_config)
                    and stored.get("num_clients") == self.num_clients):
                return stored
            print(f"{path}: ran under another protocol (COMMON, the pool, the scenario or "
                  "the number of clients changed since); not used", file=sys.stderr)
        if self.federation is None or not may_run:
            return None
        commit = produced_by("pyproject.toml", *app_packages())  # the code the run starts with
        run = self.federation.run(ROOT, run_config, num_supernodes=self.num_clients,
                                  timeout=1800)
        if not run.ok:
            print(run.output[-3000:], file=sys.stderr)
            print(f"{scenario} {item.label} {config_tag(config)} seed {seed}: run failed "
                  f"({run.status}); not stored, the next invocation tries again",
                  file=sys.stderr)
            return None
        record = {"scenario": scenario, "label": item.label, "stage": stage,
                  "config": config, "seed": seed, "run_config": run_config,
                  "num_clients": self.num_clients, "commit": commit,
                  **summarize_run(json.loads((out / "results.json").read_text()))}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
        print(f"{scenario} {item.label} {config_tag(config)} seed {seed}: "
              f"acc {record['accuracy_weighted']:.4f} min {record['accuracy_min']:.4f} "
              f"{record['seconds_total']:.0f} s", flush=True)
        return record

    def tuned(self, scenario: str, item: Entry, tune: bool) -> tuple[dict[str, Any], bool]:
        """The configuration to report and whether the whole grid was run for it."""
        cells = [(c, self.cell(scenario, item, "tune", c, TUNING_SEED, may_run=tune))
                 for c in tuning_grid(item.method)]
        done = [(c, r) for c, r in cells if r is not None]
        if len(done) < len(cells):
            return {}, False
        return max(done, key=lambda cr: cr[1]["accuracy_weighted"])[0], True


    def ablation(self, ablation: Ablation, may_run: bool = True) -> list[dict[str, Any]]:
        """The ablation's cells on the report seeds (none before its row is tuned)."""
        [(_, item)] = select([ablation.scenario], [f"{ablation.scenario}/{ablation.label}"])
        config, tuned = self.tuned(ablation.scenario, item, tune=False)
        if not tuned:
            print(f"{ablation.scenario}/{ablation.label}: not tuned yet, no ablation",
                  file=sys.stderr)
            return []
        return [c for seed in REPORT_SEEDS if (c := self.cell(
            ablation.scenario, item, "ablation", {**config, **ablation.change}, seed,
            may_run=may_run)) is not None]


def select(scenarios: list[str], only: list[str]) -> list[tuple[str, Entry]]:
    """The rows of ``scenarios`` that ``only`` names (a label, a method, or
    ``scenario/label``; empty: all)."""
    return [(s, e) for s in scenarios for e in SCENARIOS[s][1]
            if not only or {e.label, e.method, f"{s}/{e.label}"} & set(only)]


def run(matrix: Matrix, chosen: list[tuple[str, Entry]], stage: str) -> None:
    """Row by row, in the order given: its tuning runs, then its report seeds (so a stop
    leaves whole rows behind)."""
    for scenario, item in chosen:
        if stage in ("tune", "all"):
            matrix.tuned(scenario, item, tune=True)
        if stage in ("report", "all"):
            config, _ = matrix.tuned(scenario, item, tune=False)
            for seed in REPORT_SEEDS:
                matrix.cell(scenario, item, "report", config, seed)


# --------------------------------------------------------------------------- the report

def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for a single seed)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def row_stats(matrix: Matrix, scenario: str, item: Entry) -> dict[str, Any] | None:
    config, tuned = matrix.tuned(scenario, item, tune=False)
    cells = [c for seed in REPORT_SEEDS if (c := matrix.cell(
        scenario, item, "report", config, seed, may_run=False)) is not None]
    if not cells:
        return None

    def over_seeds(key: str) -> tuple[float, float]:
        return mean_std([c[key] for c in cells])

    return {"label": item.label, "config": config_tag(config), "tuned": tuned,
            "seeds": len(cells), "accuracy": over_seeds("accuracy_weighted"),
            "accuracy_min": over_seeds("accuracy_min"), "mb_up": over_seeds("mb_up_total"),
            "seconds": over_seeds("seconds_total"), "cells": cells}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| method | configuration | seeds | final acc (mean ± std) | min client | "
             "uplink MB (total) | seconds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        config = r["config"] + ("" if r["tuned"] else " (not tuned yet)")
        lines.append(f"| {r['label']} | {config} | {r['seeds']} | "
                     f"{r['accuracy'][0]:.4f} ± {r['accuracy'][1]:.4f} | "
                     f"{r['accuracy_min'][0]:.4f} | {r['mb_up'][0]:.2f} | "
                     f"{r['seconds'][0]:.0f} |")
    return "\n".join(lines) + "\n"


def ablation_stats(matrix: Matrix, stats: dict[str, dict[str, dict[str, Any]]]
                   ) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Each ablation whose row is in the report, over its report seeds; keyed by scenario,
    row label and the change's tag."""
    out = {}
    for ablation in ABLATIONS:
        row = stats.get(ablation.scenario, {}).get(ablation.label)
        cells = matrix.ablation(ablation, may_run=False)
        if row is None or not cells:
            continue
        out[(ablation.scenario, ablation.label, config_tag(ablation.change))] = {
            "ablation": ablation, "row": row, "seeds": len(cells),
            "accuracy": mean_std([c["accuracy_weighted"] for c in cells]),
            "accuracy_min": mean_std([c["accuracy_min"] for c in cells])}
    return out


def ablation_table(ablated: dict[tuple[str, str, str], dict[str, Any]]) -> str:
    """Each ablation against its row, both on the report seeds."""
    lines = ["| row | change | question | seeds | final acc (mean ± std) | min client | "
             "row's final acc | difference (points) |", "|---|---|---|---|---|---|---|---|"]
    for result in ablated.values():
        ablation, row = result["ablation"], result["row"]
        mean, std = result["accuracy"]
        lines.append(
            f"| {ablation.scenario}/{ablation.label} ({row['config']}) | "
            f"{config_tag(ablation.change)} | {ablation.question} | {result['seeds']} | "
            f"{mean:.4f} ± {std:.4f} | {result['accuracy_min'][0]:.4f} | "
            f"{row['accuracy'][0]:.4f} | {100 * (mean - row['accuracy'][0]):+.1f} |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def claims(stats: dict[str, dict[str, dict[str, Any]]],
           ablated: dict[tuple[str, str, str], dict[str, Any]] | None = None) -> list[str]:
    """Each paper claim checked against the table's means (and, for FedFac's split, its
    same-size random split in ``ablated``); "not measured" where a row or that reference is
    missing. Points are accuracy percentage points."""

    def every_seed(result: dict[str, Any] | None) -> bool:
        """A verdict needs every report seed of a row or reference."""
        return bool(result) and result["seeds"] == len(REPORT_SEEDS)

    def complete(scenario: str, label: str) -> dict[str, Any] | None:
        """The row if it is tuned and has every report seed."""
        row = stats.get(scenario, {}).get(label)
        return row if every_seed(row) and row["tuned"] else None

    def acc(scenario: str, label: str) -> float | None:
        row = complete(scenario, label)
        return None if row is None else 100 * row["accuracy"][0]

    def same_size_random(label: str) -> float | None:
        """FedFac's split claim's reference: its row's random split of the same size."""
        found = (ablated or {}).get(("synthetic-fedfac", label,
                                     config_tag(SAME_SIZE_RANDOM_SPLIT)))
        return 100 * found["accuracy"][0] if every_seed(found) else None

    def verdict(name: str, values: list[float | None], held: Any, detail: str) -> str:
        if any(v is None for v in values):
            return f"- {name}: **not measured** (rows missing or incomplete)"
        result = "held" if held(*values) else "did not hold"
        return f"- {name}: **{result}** ({detail.format(*values)})"

    out = [
        verdict("FedDecomp >= FedAvg + 5 points on Dirichlet 0.1",
                [acc("dirichlet-0.1", "feddecomp"), acc("dirichlet-0.1", "fedavg")],
                lambda a, b: a >= b + 5, "{:.1f} vs {:.1f}"),
        verdict("FedDecomp not below the best of FedPer/FedRep by more than 1 point",
                [acc("dirichlet-0.1", "feddecomp"), acc("dirichlet-0.1", "fedper"),
                 acc("dirichlet-0.1", "fedrep")],
                lambda a, b, c: a >= max(b, c) - 1, "{:.1f} vs FedPer {:.1f}, FedRep {:.1f}"),
        verdict("pFedC >= FedAvg + 5 points on pathological-2",
                [acc("pathological-2", "pfedc"), acc("pathological-2", "fedavg")],
                lambda a, b: a >= b + 5, "{:.1f} vs {:.1f}"),
        verdict("pFedC not below FedRep by more than 1 point on pathological-2",
                [acc("pathological-2", "pfedc"), acc("pathological-2", "fedrep")],
                lambda a, b: a >= b - 1, "{:.1f} vs {:.1f}"),
    ]
    ffl = complete("permuted-labels", "factorized-fl")
    avg = complete("permuted-labels", "fedavg")
    out.append(verdict(
        "Factorized-FL >= Local - 1 point on permuted labels at <= 1/20 of FedAvg's uplink",
        [acc("permuted-labels", "factorized-fl"), acc("permuted-labels", "local"),
         ffl and ffl["mb_up"][0], avg and avg["mb_up"][0]],
        lambda a, b, u, f: a >= b - 1 and u <= f / 20,
        "{:.1f} vs Local {:.1f}; uplink {:.2f} vs FedAvg {:.2f} MB"))
    for label in ("fedfac", "fedfac@dynamic"):
        out.append(verdict(f"FedFac ({label}) >= FedAvg + 3 points on Dirichlet 0.1",
                           [acc("dirichlet-0.1", label), acc("dirichlet-0.1", "fedavg")],
                           lambda a, b: a >= b + 3, "{:.1f} vs {:.1f}"))
        out.append(verdict(f"FedFac ({label}) split at least as good as a random split "
                           "of the same size (eq. 8 simulation)",
                           [acc("synthetic-fedfac", label), same_size_random(label)],
                           lambda a, b: a >= b, "{:.1f} vs random {:.1f}"))
    return out


def plots(stats: dict[str, dict[str, dict[str, Any]]], out: Path) -> list[str]:
    """Accuracy per round (mean, band = min..max over seeds), one figure per scenario, and
    final accuracy against total uplink MB; returns the files written."""
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
        ax.set(title=scenario, xlabel="uplink MB (total, log)", ylabel="final accuracy",
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
        f"seed {TUNING_SEED} (four runs per method: the learning rate, and the main "
        "hyperparameter where a method has one, by final-round accuracy), reported on seeds "
        f"{', '.join(map(str, REPORT_SEEDS))}: final-round personalized accuracy weighted by "
        "test examples, mean ± std over seeds (never the best round); min client = mean over "
        "seeds of the lowest client's final accuracy; uplink and seconds per run. "
        "A row marked *not tuned yet* ran its defaults.\n\n",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma-separated, default all")
    parser.add_argument("--only", default="",
                        help="comma-separated labels, methods or scenario/label")
    parser.add_argument("--stage", choices=("all", "tune", "report"), default="all",
                        help="report alone runs untuned rows on their defaults")
    parser.add_argument("--write-only", action="store_true", help="no runs, only the report")
    parser.add_argument("--ablations", action="store_true",
                        help="run the ablations of tuned rows (ABLATIONS), then the report")
    args = parser.parse_args()
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    common = {**COMMON, "dataset": str(pool_file())}
    command = "python bench/matrix.py"
    only = [o for o in args.only.split(",") if o]
    if not args.write_only:
        with LocalFederation() as federation:
            matrix = Matrix(federation, common)
            if not args.ablations:
                run(matrix, select(args.scenarios.split(","), only), args.stage)
            if args.ablations or (not only and args.stage == "all"):
                for ablation in ABLATIONS:  # the whole matrix ends with them
                    if ablation.scenario in args.scenarios.split(","):
                        matrix.ablation(ablation)
    print(write_report(Matrix(None, common), command))


if __name__ == "__main__":
    main()
