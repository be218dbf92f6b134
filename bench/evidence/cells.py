"""Cells: one run each, stored as JSON, run only when missing (so the matrix resumes)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from bench.evidence import protocol
from bench.evidence.mechanism import MU_DENSITY, mechanism_off, recorded_mu_density
from bench.evidence.protocol import (
    SCENARIOS,
    Ablation,
    Entry,
    ablation_seeds,
    cell_path,
    cells_folder,
    expand,
    exploratory_seeds,
    learning_rate_stage,
    next_learning_rate,
    settings_stage,
    with_change,
)
from bench.evidence.rounds import at_length, lengths, prefix, validation_converged
from bench.report import RESULTS, gpu_name, numerics, produced_by
from comparison.runs import RunStore, read_results
from comparison.stats import choose, config_tag, not_diverged, run_figures
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
    each simulated client gets its share of the GPU (``launch.ray_head.gpus_per_client``).
    ``runs``: where the runs write their output folders (default ``out/matrix/runs``);
    ``reuse``: the results folder of an earlier protocol whose cells are taken over where
    they are current (``take_over``)."""

    def __init__(self, federation: LocalFederation | None, common: dict[str, Any],
                 out: Path = RESULTS, num_clients: int | None = None,
                 tuning: dict[str, Any] | None = None, runs: Path | None = None,
                 reuse: Path | None = None) -> None:
        self.federation = federation
        self.common = common
        self.tuning = protocol.TUNING if tuning is None else tuning
        self.out = out
        self.runs = runs or out / "matrix" / "runs"
        self.reuse = reuse
        self.num_clients = num_clients
        self.device = str(common.get("device", "auto"))
        self.gpus_per_client = gpus_per_client(self.device)
        self.store = RunStore(app_defaults(ROOT), REGISTRY, self._run, stamp=self._stamp)
        self._rounds: dict[str, int] = {}  # a scenario's R, once fixed (it never changes)
        self._chosen: dict[str, list[tuple[Entry, dict[str, Any]]] | None] = {}

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
        configuration chosen on another scenario (``searched_on``). A Factorized-FL cell run
        here carries mu's density where the run recorded it (``mechanism.MU_DENSITY``)."""
        path, out = self._where(scenario, item.label, stage, config, seed)
        run_config = self.run_config(scenario, item, stage, config, seed, out)
        context = {"num_clients": self.clients(scenario)}
        # not a privacy cell (the accountant changed since v3), nor a Factorized-FL report
        # cell: v3's lack mu's density, which v4 reports
        if not path.exists() and stage != "privacy" and not (
                item.method == "factorized-fl" and stage == "report"):
            self.take_over(path, path.relative_to(self.out), run_config, context)
        entry = self.store.get(
            path, run_config, name=f"{scenario} {item.label} {config_tag(config)} seed {seed}",
            about={"scenario": scenario, "label": item.label, "stage": stage,
                   "config": config, "seed": seed},
            context=context, may_run=may_run and self.federation is not None,
            diverged_is_result=True)
        # a run here (a new cell, or a stored one that was no longer current and ran again)
        # left its results.json under ``out``
        if (entry is not None and item.method == "factorized-fl" and MU_DENSITY not in entry
                and entry.get("status") != "diverged" and (out / "results.json").exists()):
            density = recorded_mu_density(read_results(out))
            if density is None:
                print(f"{path.name}: no mu density recorded (its run's results.json has no "
                      "mu_density)", file=sys.stderr)
            else:
                entry[MU_DENSITY] = density
                path.write_text(json.dumps(entry, indent=1))
        return entry

    def replay(self, stored: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """A stored cell run again as it ran: its resolved run config (the app's defaults of
        then, not today's) on its number of clients, stored under this matrix's folder; and
        what today's matrix would run differently for that cell (``key=value`` of today's
        resolved config, each key whose value differs; empty where the cell is current)."""
        scenario, label, stage = stored["scenario"], stored["label"], stored["stage"]
        config, seed = stored["config"], stored["seed"]
        path, out = self._where(scenario, label, stage, config, seed)
        then = {**stored["resolved_config"], "output-dir": str(out)}
        today = self.store.resolved(self.run_config(
            scenario, row_entry(scenario, label), stage, config, seed, out))
        # a setting the app gained since runs at today's default in the replay too
        replayed = self.store.resolved(then)
        differs = ", ".join(f"{k}={today.get(k)}" for k in sorted(set(today) | set(replayed))
                            if k != "output-dir" and today.get(k) != replayed.get(k))
        entry = self.store.get(
            path, then, name=f"{scenario} {label} {config_tag(config)} seed {seed}",
            about={k: stored[k] for k in ("scenario", "label", "stage", "config", "seed")},
            context={"num_clients": stored["num_clients"]},
            may_run=self.federation is not None, diverged_is_result=True)
        return entry, differs

    def _where(self, scenario: str, label: str, stage: str, config: dict[str, Any],
               seed: int) -> tuple[Path, Path]:
        """A cell's file, and the output folder its run writes (under ``runs``)."""
        path = cell_path(self.out, scenario, label, stage, config, seed, self.device)
        cells = self.out / "matrix" / cells_folder(self.device)
        return path, self.runs / path.relative_to(cells).with_suffix("")

    def take_over(self, path: Path, relative: Path, run_config: dict[str, Any],
                  context: dict[str, Any]) -> None:
        """An earlier protocol's cell of the same run, copied to ``path`` (marked
        ``reused_from``) where it is current: its resolved configuration, the rounds and the
        data file among it, equals today's up to the keys that change no number, and so does
        its number of clients (``RunStore.is_current``, the rule every cell is reused by).
        ``cell`` says which cells may be (not a privacy cell, nor a Factorized-FL report
        cell). The app's code is not
        compared: each cell names the commit that ran it."""
        old = (self.reuse / relative) if self.reuse is not None else None
        if old is None or not old.exists():
            return
        stored = json.loads(old.read_text())
        if self.store.is_current(stored, run_config, context):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**stored, "reused_from": str(relative)}, indent=1))

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
            for c in configs if tune else ():  # before one runs: a searched one is the method
                if off := mechanism_off(item.method, self._resolved(scenario, item, c)):
                    raise ValueError(f"{scenario}/{item.label} {config_tag(c)}: {'; '.join(off)}"
                                     ": an ablation, not a searched configuration")
            return [(c, self.cell(scenario, item, "tune", c, SCENARIOS[scenario].tuning_seed,
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

    def base_rounds(self, scenario: str) -> int:
        """The scenario's base rounds: the search's length."""
        return int({**self.common, **SCENARIOS[scenario].config}["num-server-rounds"])

    def rounds(self, scenario: str, may_run: bool = False) -> int | None:
        """The scenario's rounds R (``bench/evidence/rounds.py``), read from the tuning runs
        of every row at its chosen configuration, length by length; None while a row's
        search or one of those runs is missing. ``may_run``: run the missing ones (once every
        row's search is complete)."""
        if scenario in self._rounds:
            return self._rounds[scenario]
        chosen = self.chosen_configs(scenario)
        if chosen is None:
            return None
        base = self.base_rounds(scenario)
        for length in lengths(base):
            cells = [self.cell(scenario, item, "tune", at_length(config, length, base),
                               SCENARIOS[scenario].tuning_seed, may_run=may_run)
                     for item, config in chosen]
            if None in cells:
                return None
            if length == lengths(base)[-1] or all(map(validation_converged, cells)):
                self._rounds[scenario] = length
                return length
        raise AssertionError("unreachable")

    def chosen_configs(self, scenario: str) -> list[tuple[Entry, dict[str, Any]]] | None:
        """Every row of the scenario with its chosen configuration; None before all are."""
        if scenario in self._rounds:  # fixed: every search was complete, and stays so
            return self._chosen[scenario]
        chosen = [(item, *self.tuned(scenario, item, tune=False))
                  for item in SCENARIOS[scenario].entries]
        self._chosen[scenario] = (None if not all(t for *_, t in chosen)
                                  else [(i, c) for i, c, _ in chosen])
        return self._chosen[scenario]

    def length_cells(self, scenario: str) -> dict[int, dict[str, dict[str, Any]]]:
        """The tuning runs the scenario's rounds were read from, by length and row (up to R;
        those stored while R is not fixed)."""
        chosen, base = self.chosen_configs(scenario) or [], self.base_rounds(scenario)
        rounds = self.rounds(scenario)
        return {length: found for length in lengths(base) if rounds is None or length <= rounds
                if (found := {item.label: c for item, config in chosen
                              if (c := self.cell(scenario, item, "tune",
                                                 at_length(config, length, base),
                                                 SCENARIOS[scenario].tuning_seed,
                                                 may_run=False))})}

    def validation(self, scenario: str, item: Entry) -> dict[str, float] | None:
        """The row's figures on validation at the scenario's rounds (its tuning run at its
        chosen configuration there): what a claim's reference is chosen by, never a report
        seed's. None before R is fixed, or where that run diverged."""
        rounds = self.rounds(scenario)
        cell = self.length_cells(scenario).get(rounds or -1, {}).get(item.label)
        if cell is None or cell.get("status") == "diverged":
            return None
        figures = run_figures(cell)
        return {k: figures[k] for k in ("accuracy", "task_accuracy") if k in figures}

    def reported(self, scenario: str, item: Entry) -> tuple[dict[str, Any], bool]:
        """The configuration the row reports, and whether its search is complete: the tuned
        one (its defaults while not) at the scenario's rounds R, at its base rounds while R is
        not fixed (``--stage report`` alone: provisional)."""
        config, tuned = self.tuned(scenario, item, tune=False)
        base = self.base_rounds(scenario)
        return at_length(config, self.rounds(scenario) or base, base), tuned

    def ablation(self, ablation: Ablation, may_run: bool = True) -> list[dict[str, Any]]:
        """The ablation's cells (``protocol.ablation_seeds``), at the scenario's rounds R:
        none before its row is tuned and R is fixed, nor where the change is already the
        row's configuration (``redundant``)."""
        item = row_entry(ablation.scenario, ablation.label)
        config, tuned = self.reported(ablation.scenario, item)
        why = ("not tuned yet" if not tuned
               else "its scenario's rounds are not fixed yet" if self.rounds(
                   ablation.scenario) is None
               else "the row's configuration already has this change: its own cells answer "
                    "the question" if self.unchanged(ablation.scenario, item, config,
                                                     ablation.change)
               else "")
        if why:
            if may_run:  # asked to run it: say why nothing ran
                print(f"{ablation.scenario}/{ablation.label} {config_tag(ablation.change)}: "
                      f"{why}; no ablation", file=sys.stderr)
            return []
        return [c for seed in ablation_seeds(ablation) if (c := self.cell(
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
        """A privacy cell (``protocol.PRIVACY``) on each exploratory seed, and the row's report
        cells without DP on the same seeds, read at the base rounds (``rounds.prefix``; both
        empty before the row is tuned): the row's tuned configuration at its scenario's base
        rounds, whatever its R, so that every row spends the same epsilon at a noise level."""
        item = row_entry(entry.scenario, entry.label)
        config, tuned = self.tuned(entry.scenario, item, tune=False)
        if not tuned:
            return [], []
        level, base = with_change(config, entry.change), self.base_rounds(entry.scenario)
        private = [c for seed in exploratory_seeds()
                   if (c := self.cell(entry.scenario, item, "privacy", level, seed,
                                      may_run=may_run)) is not None]
        reported, _ = self.reported(entry.scenario, item)
        clean = [prefix(c, base) for seed in exploratory_seeds()
                 if (c := self.cell(entry.scenario, item, "report", reported, seed,
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
    """Scenario by scenario, in the order given: each chosen row's search, then the scenario's
    rounds R (``Matrix.rounds``: its rows' tuning runs at longer lengths, once every row of it
    is tuned), then each chosen row's report seeds at R, row by row (so a stop leaves whole
    rows behind). No report seed runs on ``all`` before R is fixed, nor for a row whose
    search did not complete (a tuning run failed): they would run its defaults at the base
    rounds, which ``report`` alone is for."""
    for scenario in dict.fromkeys(s for s, _ in chosen):
        items = [item for s, item in chosen if s == scenario]
        tuned = {item.label: matrix.tuned(scenario, item, tune=stage != "report")[1]
                 for item in items}
        if stage != "report":
            for label in [label for label, done in tuned.items() if not done]:
                print(f"{scenario}/{label}: its search did not complete (a tuning run failed: "
                      "above)" + ("; no report seeds" if stage == "all" else ""),
                      file=sys.stderr)
            if matrix.rounds(scenario, may_run=True) is None:
                print(f"{scenario}: its rounds are not fixed yet (every row's search complete, "
                      "then their tuning runs at longer lengths)"
                      + ("; no report seeds" if stage == "all" else ""), file=sys.stderr)
                continue
        if stage == "tune":
            continue
        for item in items:
            if stage == "all" and not tuned[item.label]:
                continue
            config, _ = matrix.reported(scenario, item)
            for seed in protocol.REPORT_SEEDS:
                matrix.cell(scenario, item, "report", config, seed)
