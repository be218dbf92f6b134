"""Cells: one run each, stored as JSON, run only when missing (so the matrix resumes)."""

from __future__ import annotations

import os
import sys
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
    next_learning_rate,
    settings_stage,
    with_change,
)
from bench.report import RESULTS, gpu_name, numerics, produced_by
from comparison.runs import RunStore
from comparison.stats import (
    by_seed_finished,
    choose,
    config_tag,
    converged,
    not_diverged,
    slope,
)
from launch.app_project import app_defaults, app_packages
from launch.federation import FlowerRun, LocalFederation
from launch.ray_head import gpus_per_client
from strategies.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[2]


class Matrix:
    """The cells under ``out``: stored ones are read, missing ones run on ``federation`` (one
    private SuperLink) when there is one. A tuning cell runs ``common`` under ``tuning`` (its
    pool and validation split), a report or ablation cell ``common`` alone. ``num_clients``
    replaces every scenario's own (tests run three). Where ``common``'s device is ``cuda``,
    each simulated client gets its share of the GPU (``launch.ray_head.gpus_per_client``)."""

    def __init__(self, federation: LocalFederation | None, common: dict[str, Any],
                 out: Path = RESULTS, num_clients: int | None = None,
                 tuning: dict[str, Any] | None = None) -> None:
        self.federation = federation
        self.common = common
        self.tuning = protocol.TUNING if tuning is None else tuning
        self.out = out
        self.num_clients = num_clients
        self.device = str(common.get("device", "auto"))
        self.gpus_per_client = gpus_per_client(self.device)
        self.store = RunStore(app_defaults(ROOT), REGISTRY, self._run, stamp=self._stamp)

    def clients(self, scenario: str) -> int:
        return self.num_clients or SCENARIOS[scenario].num_clients

    def run_config(self, scenario: str, item: Entry, stage: str, config: dict[str, Any],
                   seed: int, out: Path) -> dict[str, Any]:
        """What one cell runs: the common settings (a tuning cell's under ``tuning``), the
        scenario's, the row's, the config."""
        common = {**self.common, **self.tuning} if stage == "tune" else self.common
        return {**common, **SCENARIOS[scenario].config, **item.fixed, **expand(config),
                "method": item.method, "seed": seed, "output-dir": str(out)}

    def method_config(self, scenario: str, item: Entry, config: dict[str, Any]
                      ) -> dict[str, Any]:
        """A searched configuration in full: every key it sets (a common knob such as
        ``local-epochs`` too, and the rounds of a convergence re-run), its learning rate and
        every setting of its method, defaults and the row's fixed ones included (what
        ``summary.json`` lists; so a row whose rounds were doubled has a ``chosen`` that is
        not an entry of its ``grid``)."""
        resolved = self._resolved(scenario, item, config)
        return {k: v for k, v in resolved.items()
                if k == "lr" or k.startswith(f"{item.method}.") or k in expand(config)}

    def cell(self, scenario: str, item: Entry, stage: str, config: dict[str, Any],
             seed: int, may_run: bool = True) -> dict[str, Any] | None:
        """The stored cell, if it is current (``comparison.runs``: today's protocol,
        defaults and number of clients); else run it (``may_run``). A cell that diverged
        is a result, stored as such, at every stage: a run here is the same run again
        (``numerics``), so running it again would diverge again, and running it until it
        does not would report the lucky run. A report seed can diverge where a row runs a
        configuration chosen on another scenario (``searched_on``)."""
        path = cell_path(self.out, scenario, item.label, stage, config, seed, self.device)
        cells = self.out / "matrix" / cells_folder(self.device)
        out = self.out / "matrix" / "runs" / path.relative_to(cells).with_suffix("")
        return self.store.get(
            path, self.run_config(scenario, item, stage, config, seed, out),
            name=f"{scenario} {item.label} {config_tag(config)} seed {seed}",
            about={"scenario": scenario, "label": item.label, "stage": stage,
                   "config": config, "seed": seed},
            context={"num_clients": self.clients(scenario)},
            may_run=may_run and self.federation is not None, diverged_is_result=True)

    def _run(self, run_config: dict[str, Any], context: dict[str, Any]) -> FlowerRun:
        assert self.federation is not None
        return self.federation.run(ROOT, run_config, num_supernodes=context["num_clients"],
                                   gpus_per_client=self.gpus_per_client, timeout=3600)

    def _stamp(self) -> dict[str, Any]:
        return {"commit": produced_by("pyproject.toml", *app_packages()),
                "machine": f"{os.cpu_count()} CPU cores, device {self.device}"
                + (f" ({gpu_name()})" if self.gpus_per_client else ""),
                "numerics": numerics()}

    def searched(self, scenario: str, item: Entry, tune: bool
                 ) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
        """The row's search on the tuning seed, each configuration with its cell (None while
        missing): the learning-rate stage, its steps past the grid while its best rate is an
        end of those tried (``next_learning_rate``), then, once they are complete, the
        method's settings at the best rate, as many as the steps left of the budget.
        ``tune``: run the missing cells. A scenario ``searched_on`` another has its row's
        search there."""
        if (other := SCENARIOS[scenario].searched_on) is not None:
            return self.searched(other, item, tune)

        def cells(configs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], Any]]:
            return [(c, self.cell(scenario, item, "tune", c, protocol.TUNING_SEED,
                                  may_run=tune)) for c in configs]

        def best(tried: list[tuple[dict[str, Any], Any]]) -> float | None:
            finished = not_diverged(tried)
            return choose(finished)["lr"] if finished else None

        rates = cells(learning_rate_stage())
        while all(r is not None for _, r in rates) and (step := next_learning_rate(
                best(rates), [c["lr"] for c, _ in rates])) is not None:
            rates += cells([{"lr": step}])
        if any(r is None for _, r in rates):
            return rates
        left = len(learning_rate_stage()) + protocol.EXTRA_CONFIGS - len(rates)
        return rates + cells(settings_stage(item.method, choose(rates)["lr"], left))

    def tuned(self, scenario: str, item: Entry, tune: bool) -> tuple[dict[str, Any], bool]:
        """The configuration to report and whether the whole search ran for it: the best of
        the search by the mean of its last rounds on the tuning runs' validation splits
        (``comparison.stats.choose``; never one round's, never a test split's)."""
        return chosen(self.searched(scenario, item, tune))

    def reported(self, scenario: str, item: Entry, may_run: bool = False
                 ) -> tuple[dict[str, Any], bool]:
        """The configuration the row reports, and whether its search is complete: the tuned
        one at the scenario's rounds, with ``num-server-rounds`` doubled while its report
        seeds have not converged (``comparison.stats.converged``) and none diverged, at most
        ``MAX_DOUBLINGS`` times.
        ``may_run``: run each length's missing report seeds on the way."""
        config, tuned, _ = self.report_length(scenario, item, may_run)
        return config, tuned

    def report_length(self, scenario: str, item: Entry, may_run: bool = False
                      ) -> tuple[dict[str, Any], bool, bool]:
        """``reported``'s two, and whether the length is settled: its report seeds converged
        there, one of them diverged there (more rounds would not undo that: the row is
        reported at that length, the seed named), or it is the last doubling (a missing seed
        at an earlier length may still double it)."""
        config, tuned = self.tuned(scenario, item, tune=False)
        rounds = self._resolved(scenario, item, config)["num-server-rounds"]
        for doubling in range(protocol.MAX_DOUBLINGS + 1):
            current = config if doubling == 0 else {**config, "num-server-rounds": rounds}
            cells = [self.cell(scenario, item, "report", current, seed, may_run=may_run)
                     for seed in protocol.REPORT_SEEDS]
            last = doubling == protocol.MAX_DOUBLINGS
            if None in cells:
                return current, tuned, last
            finished, diverged = by_seed_finished(cells)
            if diverged or last or converged(
                    [slope(c["accuracy_per_round"]) for c in finished.values()]):
                return current, tuned, True
            rounds *= 2
        raise AssertionError("unreachable")

    def ablation(self, ablation: Ablation, may_run: bool = True) -> list[dict[str, Any]]:
        """The ablation's cells on the report seeds, at the rounds its row reports: none
        before its row is tuned and that length is settled (``report_length``: a length its
        row may still double past is not its length), nor where the change is already the
        row's configuration (``redundant``)."""
        item = row_entry(ablation.scenario, ablation.label)
        config, tuned, settled = self.report_length(ablation.scenario, item)
        why = ("not tuned yet" if not tuned
               else "its rounds are not settled (a report seed is missing)" if not settled
               else "the row's configuration already has this change: its own cells answer "
                    "the question" if self.unchanged(ablation.scenario, item, config,
                                                     ablation.change)
               else "")
        if why:
            if may_run:  # asked to run it: say why nothing ran
                print(f"{ablation.scenario}/{ablation.label} {config_tag(ablation.change)}: "
                      f"{why}; no ablation", file=sys.stderr)
            return []
        # and the extra seeds its row ran for an undecided claim (its reference, FedFac's
        # random split, is paired seed by seed)
        extra = [seed for seed in protocol.EXTRA_SEEDS if self.cell(
            ablation.scenario, item, "report", config, seed, may_run=False) is not None]
        return [c for seed in (*protocol.REPORT_SEEDS, *extra) if (c := self.cell(
            ablation.scenario, item, "ablation", with_change(config, ablation.change), seed,
            may_run=may_run)) is not None]

    def unchanged(self, scenario: str, item: Entry, config: dict[str, Any],
                  change: dict[str, Any]) -> bool:
        """Whether ``change`` leaves the run of ``config`` as it is (pFedC's MGDA-UB turned off
        where its search chose it off): every resolved key the same."""
        return (self._resolved(scenario, item, with_change(config, change))
                == self._resolved(scenario, item, config))

    def _resolved(self, scenario: str, item: Entry, config: dict[str, Any]) -> dict[str, Any]:
        """What a report run of ``config`` resolves to (the app's defaults under it)."""
        return self.store.resolved(self.run_config(scenario, item, "report", config, 0,
                                                   self.out))

    def redundant(self, ablation: Ablation) -> bool:
        """Whether the ablation's change is already its tuned row's configuration."""
        item = row_entry(ablation.scenario, ablation.label)
        config, tuned = self.reported(ablation.scenario, item)
        return tuned and self.unchanged(ablation.scenario, item, config, ablation.change)

    def privacy(self, entry: Ablation, may_run: bool = True
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """A privacy cell (``protocol.PRIVACY``) on each report seed, and the row's report
        cells without DP at the same configuration (both empty before the row is tuned): the
        row's tuned configuration at its scenario's rounds, never a doubled length, so that
        every row spends the same epsilon at a noise level."""
        item = row_entry(entry.scenario, entry.label)
        config, tuned = self.tuned(entry.scenario, item, tune=False)
        if not tuned:
            return [], []
        level = with_change(config, entry.change)
        private = [c for seed in protocol.REPORT_SEEDS
                   if (c := self.cell(entry.scenario, item, "privacy", level, seed,
                                      may_run=may_run)) is not None]
        clean = [c for seed in protocol.REPORT_SEEDS
                 if (c := self.cell(entry.scenario, item, "report", config, seed,
                                    may_run=False)) is not None]
        return private, clean


def chosen(searched: list[tuple[dict[str, Any], dict[str, Any] | None]]
           ) -> tuple[dict[str, Any], bool]:
    """A search's choice and whether the search is complete (``({}, False)`` while not)."""
    if any(r is None for _, r in searched):
        return {}, False
    return choose(searched), True


def row_entry(scenario: str, label: str) -> Entry:
    """The row ``label`` of ``scenario``."""
    [(_, item)] = select([scenario], [f"{scenario}/{label}"])
    return item


def select(scenarios: list[str], only: list[str]) -> list[tuple[str, Entry]]:
    """The rows of ``scenarios`` that ``only`` names (a label, a method, or
    ``scenario/label``; empty: all)."""
    return [(s, e) for s in scenarios for e in SCENARIOS[s].entries
            if not only or {e.label, e.method, f"{s}/{e.label}"} & set(only)]


def run(matrix: Matrix, chosen: list[tuple[str, Entry]], stage: str) -> None:
    """Row by row, in the order given: its tuning runs, then its report seeds, with more
    rounds until it converges (so a stop leaves whole rows behind). A row whose search did
    not complete (a tuning run failed) runs no report seed on ``all``: they would run its
    defaults, which ``report`` alone is for."""
    for scenario, item in chosen:
        if stage in ("tune", "all"):
            _, tuned = matrix.tuned(scenario, item, tune=True)
            if not tuned:
                print(f"{scenario}/{item.label}: its search did not complete (a tuning run "
                      "failed: above)" + ("; no report seeds" if stage == "all" else ""),
                      file=sys.stderr)
                continue
        if stage in ("report", "all"):
            matrix.reported(scenario, item, may_run=True)


