"""Cells: one run each, stored as JSON, run only when missing (so the matrix resumes)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.evidence import protocol
from bench.evidence.protocol import (
    SCENARIOS,
    Ablation,
    Entry,
    cell_path,
    cells_folder,
    expand,
    learning_rate_stage,
    settings_stage,
)
from bench.report import RESULTS, produced_by
from launch.app_project import app_defaults, app_packages
from launch.comparison import choose, comparable_config, config_tag, slope, summarize_run
from launch.federation import LocalFederation
from strategies.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[2]


class Matrix:
    """The cells under ``out``: stored ones are read, missing ones run on ``federation`` (one
    private SuperLink) when there is one. A tuning cell runs ``common`` under ``tuning`` (its
    pool and validation split), a report or ablation cell ``common`` alone. ``num_clients``
    replaces every scenario's own (tests run three)."""

    def __init__(self, federation: LocalFederation | None, common: dict[str, Any],
                 out: Path = RESULTS, num_clients: int | None = None,
                 tuning: dict[str, Any] | None = None) -> None:
        self.federation = federation
        self.common = common
        self.tuning = protocol.TUNING if tuning is None else tuning
        self.out = out
        self.num_clients = num_clients
        self.device = str(common.get("device", "auto"))
        self.defaults = app_defaults(ROOT)

    def clients(self, scenario: str) -> int:
        return self.num_clients or SCENARIOS[scenario].num_clients

    def run_config(self, scenario: str, item: Entry, stage: str, config: dict[str, Any],
                   seed: int, out: Path) -> dict[str, Any]:
        """What one cell runs: the common settings (a tuning cell's under ``tuning``), the
        scenario's, the row's, the config."""
        common = {**self.common, **self.tuning} if stage == "tune" else self.common
        return {**common, **SCENARIOS[scenario].config, **item.fixed, **expand(config),
                "method": item.method, "seed": seed, "output-dir": str(out)}

    def resolved(self, method: str, run_config: dict[str, Any]) -> dict[str, Any]:
        """The configuration a run of ``method`` resolves to (the app's defaults under
        ``run_config``), less the keys of other methods (``fedfac.layers`` does not change a
        FedAvg row's numbers)."""
        return {k: v for k, v in {**self.defaults, **run_config}.items()
                if k.split(".", 1)[0] in (k, method) or k.split(".", 1)[0] not in REGISTRY}

    def method_config(self, scenario: str, item: Entry, config: dict[str, Any]
                      ) -> dict[str, Any]:
        """A searched configuration in full: its learning rate and every setting of its
        method, defaults and the row's fixed ones included (what ``summary.json`` lists)."""
        resolved = self.resolved(item.method, self.run_config(scenario, item, "report",
                                                               config, 0, self.out))
        return {k: v for k, v in resolved.items()
                if k == "lr" or k.startswith(f"{item.method}.")}

    def cell(self, scenario: str, item: Entry, stage: str, config: dict[str, Any],
             seed: int, may_run: bool = True) -> dict[str, Any] | None:
        """The stored cell, if it ran under today's protocol and defaults; else run it
        (``may_run``)."""
        path = cell_path(self.out, scenario, item.label, stage, config, seed, self.device)
        cells = self.out / "matrix" / cells_folder(self.device)
        out = self.out / "matrix" / "runs" / path.relative_to(cells).with_suffix("")
        run_config = self.run_config(scenario, item, stage, config, seed, out)
        resolved = self.resolved(item.method, run_config)
        if path.exists():
            stored = json.loads(path.read_text())
            # filled with today's defaults: a key added since (a new option, its default
            # keeping the old behaviour) is no change; a changed default or setting is
            if ("resolved_config" in stored and stored.get("num_clients") == self.clients(scenario)
                    and comparable_config(self.resolved(item.method, stored["resolved_config"]))
                    == comparable_config(resolved)):
                return stored
            print(f"{path}: ran under another protocol (COMMON, the pool, the scenario, the "
                  "number of clients or a default changed since); not used", file=sys.stderr)
        if self.federation is None or not may_run:
            return None
        commit = produced_by("pyproject.toml", *app_packages())  # the code the run starts with
        started = time.monotonic()
        run = self.federation.run(ROOT, run_config, num_supernodes=self.clients(scenario),
                                  timeout=3600)
        wall = time.monotonic() - started
        record = {"scenario": scenario, "label": item.label, "stage": stage,
                  "config": config, "seed": seed, "run_config": run_config,
                  "resolved_config": resolved, "num_clients": self.clients(scenario),
                  "commit": commit, "wall_seconds": wall,
                  "machine": f"{os.cpu_count()} CPU cores, device {self.device}"}
        if not run.ok:
            reason = divergence(out)
            if stage not in ("tune", "privacy") or reason is None:
                print(run.output[-3000:], file=sys.stderr)
                print(f"{scenario} {item.label} {config_tag(config)} seed {seed}: run failed "
                      f"({run.status}); not stored, the next invocation tries again",
                      file=sys.stderr)
                return None
            # a configuration of the search that diverged: a result of the search, which
            # can never be chosen (launch.comparison.choose); under DP, a result of the noise
            record.update(status="diverged", reason=reason)
        else:
            record.update(summarize_run(json.loads((out / "results.json").read_text())))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1))
        figures = (f"diverged ({record['reason']})" if "reason" in record else
                   f"acc {record['accuracy_weighted']:.4f} min {record['accuracy_min']:.4f}")
        print(f"{scenario} {item.label} {config_tag(config)} seed {seed}: {figures} "
              f"{wall:.0f} s", flush=True)
        return record

    def searched(self, scenario: str, item: Entry, tune: bool
                 ) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """The row's search on the tuning seed, each configuration with its cell (None while
        missing): the learning-rate stage, then, once it is complete, the method's settings
        at the stage's best learning rate. ``tune``: run the missing cells. A scenario
        ``searched_on`` another has its row's search there."""
        if (other := SCENARIOS[scenario].searched_on) is not None:
            return self.searched(other, item, tune)

        def cells(configs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
            return [(c, self.cell(scenario, item, "tune", c, protocol.TUNING_SEED,
                                  may_run=tune)) for c in configs]

        first = cells(learning_rate_stage())
        if any(r is None for _, r in first):
            return first
        lr = choose(first)["lr"]
        return first + cells(settings_stage(item.method, lr))

    def tuned(self, scenario: str, item: Entry, tune: bool) -> tuple[dict[str, Any], bool]:
        """The configuration to report and whether the whole search ran for it: the best of
        the search by the mean of its last rounds on the tuning runs' validation splits
        (``launch.comparison.choose``; never one round's, never a test split's)."""
        return chosen(self.searched(scenario, item, tune))

    def reported(self, scenario: str, item: Entry, may_run: bool = False
                 ) -> tuple[dict[str, Any], bool]:
        """The configuration the row reports, and whether its search is complete: the tuned
        one at the scenario's rounds, with ``num-server-rounds`` doubled while its report
        seeds have not converged (``protocol.converged``), at most ``MAX_DOUBLINGS`` times.
        ``may_run``: run each length's missing report seeds on the way."""
        config, tuned = self.tuned(scenario, item, tune=False)
        rounds = self.run_config(scenario, item, "report", config, 0, self.out)[
            "num-server-rounds"]
        for doubling in range(protocol.MAX_DOUBLINGS + 1):
            current = config if doubling == 0 else {**config, "num-server-rounds": rounds}
            cells = [self.cell(scenario, item, "report", current, seed, may_run=may_run)
                     for seed in protocol.REPORT_SEEDS]
            if (doubling == protocol.MAX_DOUBLINGS or any(c is None for c in cells)
                    or protocol.converged([slope(c["accuracy_per_round"]) for c in cells])):
                return current, tuned
            rounds *= 2
        raise AssertionError("unreachable")

    def ablation(self, ablation: Ablation, may_run: bool = True) -> list[dict[str, Any]]:
        """The ablation's cells on the report seeds, at the rounds its row reports (none
        before its row is tuned)."""
        [(_, item)] = select([ablation.scenario], [f"{ablation.scenario}/{ablation.label}"])
        config, tuned = self.reported(ablation.scenario, item)
        if not tuned:
            if may_run:  # asked to run it: say why nothing ran
                print(f"{ablation.scenario}/{ablation.label}: not tuned yet, no ablation",
                      file=sys.stderr)
            return []
        # and the extra seeds its row ran for an undecided claim (its reference, FedFac's
        # random split, is paired seed by seed)
        extra = [seed for seed in protocol.EXTRA_SEEDS if self.cell(
            ablation.scenario, item, "report", config, seed, may_run=False) is not None]
        return [c for seed in (*protocol.REPORT_SEEDS, *extra) if (c := self.cell(
            ablation.scenario, item, "ablation", {**config, **ablation.change}, seed,
            may_run=may_run)) is not None]

    def privacy(self, entry: Ablation, may_run: bool = True
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """A privacy cell (``protocol.PRIVACY``) on each report seed, and the row's report
        cells without DP at the same configuration (both empty before the row is tuned): the
        row's tuned configuration at its scenario's rounds, never a doubled length, so that
        every row spends the same epsilon at a noise level."""
        [(_, item)] = select([entry.scenario], [f"{entry.scenario}/{entry.label}"])
        config, tuned = self.tuned(entry.scenario, item, tune=False)
        if not tuned:
            return [], []
        private = [c for seed in protocol.REPORT_SEEDS
                   if (c := self.cell(entry.scenario, item, "privacy", {**config, **entry.change},
                                      seed, may_run=may_run)) is not None]
        clean = [c for seed in protocol.REPORT_SEEDS
                 if (c := self.cell(entry.scenario, item, "report", config, seed,
                                    may_run=False)) is not None]
        return private, clean

def divergence(out: Path) -> str | None:
    """Why a failed run under ``out`` diverged (its clients' losses or arrays stopped being
    finite, so that no reply was valid), or None where it failed otherwise (a crash, a
    timeout: not stored, tried again)."""
    path = out / "results.json"
    if not path.exists():
        return None
    results = json.loads(path.read_text())
    reason = str(results.get("reason", ""))
    return reason if results.get("status") == "failed" and "not finite" in reason else None


def chosen(searched: list[tuple[dict[str, Any], dict[str, Any] | None]]
           ) -> tuple[dict[str, Any], bool]:
    """A search's choice and whether the search is complete (``({}, False)`` while not)."""
    if any(r is None for _, r in searched):
        return {}, False
    return choose(searched), True


def select(scenarios: list[str], only: list[str]) -> list[tuple[str, Entry]]:
    """The rows of ``scenarios`` that ``only`` names (a label, a method, or
    ``scenario/label``; empty: all)."""
    return [(s, e) for s in scenarios for e in SCENARIOS[s].entries
            if not only or {e.label, e.method, f"{s}/{e.label}"} & set(only)]


def run(matrix: Matrix, chosen: list[tuple[str, Entry]], stage: str) -> None:
    """Row by row, in the order given: its tuning runs, then its report seeds, with more
    rounds until it converges (so a stop leaves whole rows behind)."""
    for scenario, item in chosen:
        if stage in ("tune", "all"):
            matrix.tuned(scenario, item, tune=True)
        if stage in ("report", "all"):
            matrix.reported(scenario, item, may_run=True)


