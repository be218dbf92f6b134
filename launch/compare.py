"""Compare methods on your own setup, over seeds: every run through the real app, one report.

    bash scripts/compare.sh --methods fedavg,fedper,feddecomp --seeds 1,2,3 \\
        dataset=/data/my-images partitioner=dirichlet num-server-rounds=30

Each ``--methods`` entry is ``METHOD[@TAG][:key=value;key=value|value]``: the row is labelled
``METHOD@TAG`` and runs with those overrides on top of the command's ``key=value`` ones; a
value list ``a|b`` makes a grid. ``--lr-grid`` gives every row the same learning rates.

Protocol (docs/comparing.md): a row with more than one configuration is tuned first, each
configuration run once on ``--tuning-seed`` (not a report seed) with ``--validation-fraction``
of every client's training share held out as its validation split, and the one with the best
mean validation accuracy over its last rounds is kept (``comparison.stats.choose``: no test
split is read to choose); then every row runs its configuration on each of ``--seeds``.
The report (``report.md``, ``summary.json`` and two plots) gives, per row, the
statistics of ``comparison/stats.py`` (the evidence matrix's): the mean over seeds of each
run's personalized accuracy over its last 5 rounds (none in the first quarter of its rounds:
a run of 5 rounds is read on rounds 3-5, as the report and a warning say), the lowest
client's, the slope over the last 10 rounds, uplink and time, and the paired difference per
seed against ``--reference`` with its 95% interval; in points in the report and the printed
lines, in fractions in ``summary.json`` (its ``units`` say so). The evidence matrix's two
rules too: a report seed that diverged or collapsed is unstable, and its row is never called
not worse or better; the rows of ``--primary`` (default: all but the reference) are judged
together with Holm's correction, the others are exploratory.

Everything is written under ``--out`` (default ``outputs/compare-<UTC time>`` in the current
folder), each run in ``runs/<row>/<stage>-<config>-seed<k>/`` with its record beside it
(``comparison.runs``): a run whose record is current is not run again, so an interrupted
comparison resumes. Exit 0 when every run completed, 1 when some failed (the report says
which), 2 for a mistake in the command.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunSettings
from comparison.multiplicity import judge_rows
from comparison.report import (
    UNITS,
    run_text,
    short_runs_warning,
    write_report,
)
from comparison.runs import RunStore
from comparison.stats import (
    choose,
    config_tag,
    method_stats,
    run_figures,
    run_window,
    seeds_named,
    stability,
)
from fldata import pool_source
from launch.app_project import app_defaults
from launch.federation import FlowerRun, LocalFederation, warm_federation
from launch.run_config import check_run_config, parse_overrides
from strategies.registry import REGISTRY

APP_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    """One row of the comparison: a method with its fixed overrides and its grid."""

    label: str
    method: str
    grid: list[dict[str, Any]]  # overrides per configuration (one: nothing to tune)


# what every row of a comparison shares: its training budget (rounds, and a round's steps and
# clients: a smaller batch takes more steps an epoch)
EQUAL_BUDGET = {"num-server-rounds", "local-epochs", "batch-size", "fraction-train"}


def parse_row(entry: str, defaults: dict[str, Any], lr_grid: Sequence[float]) -> Row:
    """``METHOD[@TAG][:key=value;key=a|b]`` -> its row; ``lr_grid`` unless it sets ``lr``."""
    label, _, extra = entry.partition(":")
    method = label.split("@", 1)[0]
    axes: dict[str, list[Any]] = {}
    for item in filter(None, extra.split(";")):
        name, sep, values = item.partition("=")
        if not sep:
            raise ConfigError(f"{entry!r}: an entry's override is key=value, e.g. fedprox:"
                              "fedprox.mu=0.01|0.1")
        axes[name] = [parse_overrides([f"{name}={v}"], defaults)[name]
                      for v in values.split("|")]
    for budget in EQUAL_BUDGET & set(axes):
        raise ConfigError(f"{entry!r}: {budget} is the same for every row (rows compared with "
                          f"each other train the same rounds, local epochs, batch size and "
                          f"clients a round): set it as "
                          f"the command's {budget}=N")
    if lr_grid and "lr" not in axes:
        axes["lr"] = list(lr_grid)
    grid = [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]
    return Row(label, method, grid)


class Comparison:
    """The rows' runs under ``out`` on one federation (``comparison.runs``): stored runs are
    read while current, others run."""

    def __init__(self, federation: LocalFederation | None, app: Path, base: dict[str, Any],
                 out: Path, federation_config: dict[str, Any], run_timeout: float,
                 validation_fraction: float) -> None:
        self.federation, self.app, self.base = federation, app, base
        self.validation_fraction = validation_fraction  # of a tuning run's training shares
        # the simulation's size and each client's resources (LocalFederation.federation_config)
        self.out, self.federation_config, self.run_timeout = out, federation_config, run_timeout
        self.store = RunStore(app_defaults(app), REGISTRY, self._run, prefix="[compare] ",
                              describe=run_text)
        self.run_lengths: set[int] = set()  # the runs' num-server-rounds (``check``)
        # the pool is cut in a tuning and a report part where it is read here whole (a local
        # path, digits, a local copy); a hub dataset or the synthetic generator is not
        settings = RunSettings.from_run_config({**app_defaults(app), **base})
        self.pool_parts = (settings.dataset != "synthetic-fedfac"
                           and pool_source(settings) is not None)

    def run_config(self, row: Row, stage: str, config: dict[str, Any], seed: int
                   ) -> dict[str, Any]:
        """A report run's config; a tuning run's is scored on validation splits instead, of
        the pool's tuning part where the pool can be cut (``pool_parts``): a report run then
        partitions the rest, so that no image a configuration was chosen on is in a report
        seed's split."""
        parts = {"pool-part": "tuning" if stage == "tune" else "report"} if self.pool_parts else {}
        tuning = {"validation-fraction": self.validation_fraction} if stage == "tune" else {}
        return {**self.base, **config, **tuning, **parts, "method": row.method, "seed": seed,
                "plot": False}

    def check(self, rows: Sequence[Row], seeds: Sequence[int]) -> None:
        """Every configuration checked before any run starts (one-line ConfigError)."""
        for row in rows:
            for config in row.grid:
                try:
                    stage = "tune" if len(row.grid) > 1 else "report"
                    settings = check_run_config(self.run_config(row, stage, config, seeds[0]),
                                                self.app)
                    if settings.fraction_evaluate == 0:
                        raise ConfigError("fraction-evaluate: 0 evaluates nothing to compare")
                    self.run_lengths.add(settings.num_server_rounds)
                except ConfigError as error:
                    raise ConfigError(f"{row.label} {config_tag(config)}: {error}") from None
        # the data split, the same for every row: drawable for every seed (the partition depends
        # on the seed), with the warning about small evaluation splits printed once
        clients = self.federation_config["num-supernodes"]
        for seed in seeds:
            try:
                check_run_config(self.run_config(rows[0], "report", rows[0].grid[0], seed),
                                 self.app, clients)
            except ConfigError as error:
                raise ConfigError(f"seed {seed}: {error}") from None

    def summary(self, row: Row, stage: str, config: dict[str, Any], seed: int
                ) -> dict[str, Any] | None:
        """The run's record (``comparison.runs``: its summary, ``summarize_run``'s keys):
        stored if it is current, else run; None if it failed. A report run that diverged is
        a result, as in the evidence matrix (stored: it would diverge again; ``"status":
        "diverged"``, no figures): an unstable seed of its row; a tuning run that diverged
        failed (the search cannot choose it)."""
        name = f"{stage}-{config_tag(config)}-seed{seed}"
        out = (self.out / "runs" / row.label / name).resolve()
        return self.store.get(
            out.with_name(f"{name}.json"),
            {**self.run_config(row, stage, config, seed), "output-dir": str(out)},
            name=f"{row.label} {stage} {config_tag(config)} seed {seed}",
            about={"label": row.label, "stage": stage, "config": config, "seed": seed,
                   "units": UNITS},
            context={"num_clients": self.federation_config["num-supernodes"]},
            may_run=self.federation is not None, diverged_is_result=stage == "report")

    def _run(self, run_config: dict[str, Any], context: dict[str, Any]) -> FlowerRun:
        # flwr_run, not run: ``check`` has checked every configuration already; a run past
        # --run-timeout is stopped by flwr_run, so that it does not compete with the next one
        assert self.federation is not None
        return self.federation.flwr_run(self.app, run_config, self.federation_config,
                                        timeout=self.run_timeout)

    def tune(self, row: Row, tuning_seed: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The row's configuration: its only one, or the grid's best on the tuning seed
        (``choose``: mean validation accuracy over the last rounds); and every tried
        configuration's figures, on validation splits."""
        if len(row.grid) == 1:
            return row.grid[0], []
        runs = [(config, summary) for config in row.grid
                if (summary := self.summary(row, "tune", config, tuning_seed)) is not None]
        if not runs:
            raise RuntimeError(f"{row.label}: every tuning run failed")
        return choose(runs), [
            {"config": config, "evaluated_on": summary["evaluated_on"],
             "window": run_window(summary),
             **run_figures(summary)} for config, summary in runs]


def budgets(rows: Sequence[Row]) -> dict[str, int]:
    """How many configurations each row searches (its tuning budget)."""
    return {row.label: len(row.grid) for row in rows}


def compare(comparison: Comparison, rows: Sequence[Row], seeds: Sequence[int],
            tuning_seed: int, reference: str, margin: float,
            primary: Sequence[str] | None = None) -> dict[str, Any]:
    """Tune, then run every row on every seed; the summary (``summary.json``): each row's
    statistics over its report seeds that did not diverge, its unstable seeds
    (``stability``), and its claim against the reference (``judge_rows``: ``primary``, by
    default every row but the reference, judged together with Holm's correction)."""
    family = [r.label for r in rows if r.label != reference] if primary is None else primary
    summary: dict[str, Any] = {"units": UNITS,
                               "protocol": {"seeds": list(seeds), "tuning_seed": tuning_seed,
                                            "clients":
                                                comparison.federation_config["num-supernodes"],
                                            "selection": "validation",
                                            "validation_fraction":
                                                comparison.validation_fraction,
                                            "budgets": budgets(rows),
                                            "reference": reference, "margin": margin,
                                            "primary": list(family),
                                            "base_config": comparison.base},
                               "rows": {}, "failed": comparison.store.failed}
    for row in rows:
        try:
            chosen, tried = comparison.tune(row, tuning_seed)
        except RuntimeError as error:
            print(f"[compare] {error}", file=sys.stderr)
            continue
        # keyed by the seed as a string, as JSON writes them
        runs = {str(seed): s for seed in seeds
                if (s := comparison.summary(row, "report", chosen, seed)) is not None}
        finished = {seed: s for seed, s in runs.items() if s.get("status") != "diverged"}
        if finished:
            stats = method_stats(finished)
            summary["rows"][row.label] = {
                "method": row.method, "grid": row.grid, "chosen": chosen, "tuning": tried,
                "curves": {seed: s["accuracy_per_round"] for seed, s in finished.items()},
                "rounds": {seed: s["rounds"] for seed, s in finished.items()},
                "window": {seed: run_window(s) for seed, s in finished.items()},
                **stats, **stability(runs, stats["per_seed"])}
        elif runs:  # no figure left: listed with the failed runs
            summary["failed"].append(f"{row.label}: diverged on every report seed "
                                     f"({seeds_named(sorted(map(int, runs)))})")
    judge_rows(summary["rows"], reference, family, margin)
    return summary


def budget_text(rows: Sequence[Row]) -> str:
    return ", ".join(f"{label} {n}" for label, n in budgets(rows).items())


def check_same_clients(out: Path, supernodes: int) -> None:
    """A comparison continued in ``out`` keeps its number of clients: the data split, which
    no run config key records, depends on it."""
    recorded = out / "clients.json"
    if recorded.exists():
        before = json.loads(recorded.read_text())["supernodes"]
        if before != supernodes:
            raise ConfigError(f"--supernodes {supernodes}: {out} holds runs with {before} "
                              "clients (another split of the data); give another --out")


def seed_list(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: seeds are integers, e.g. 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct seeds, e.g. 1,2,3")
    return seeds


def command_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/compare.sh",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--methods", required=True,
                        help="comma-separated METHOD[@TAG][:key=value;key=a|b] entries")
    parser.add_argument("--seeds", type=seed_list, default=[1, 2, 3], help="default 1,2,3")
    parser.add_argument("--reference", default="",
                        help="the row the others are compared with (default: the first)")
    parser.add_argument("--lr-grid", default="",
                        help="learning rates every row is tuned over, e.g. 0.01,0.05,0.1")
    parser.add_argument("--margin", type=float, default=-1.0,
                        help="accuracy points: a row is 'not worse' than the reference when "
                        "its difference's 95%% interval lies at or above this (default -1)")
    parser.add_argument("--primary", default="",
                        help="ROW[,ROW...]: the rows whose comparison with the reference is "
                        "judged together, with Holm's correction (default: every row but the "
                        "reference); the others are exploratory")
    parser.add_argument("--tuning-seed", type=int, default=0,
                        help="the seed grids are tuned on; not a report seed (default 0)")
    parser.add_argument("--validation-fraction", type=float, default=0.2,
                        help="of each client's training share, its validation split in "
                        "tuning runs: what a grid is chosen on (default 0.2)")
    parser.add_argument("--supernodes", type=int, default=10,
                        help="clients (the data is split into as many partitions)")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=0.0)
    parser.add_argument("--run-timeout", type=float, default=4 * 3600,
                        help="seconds one run may take before it is stopped (default 4 h)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default outputs/compare-<UTC time> in the current folder")
    parser.add_argument("--app", type=Path, default=APP_ROOT)
    parser.add_argument("overrides", nargs="*",
                        help="run-config overrides for every run, key=value (dataset=...)")
    return parser


def checked_comparison(args: argparse.Namespace, federation: LocalFederation | None
                       ) -> tuple[Comparison, list[Row], str, list[str], Path]:
    """The command's arguments checked, every configuration included, before anything
    runs: (the comparison, its rows, the reference row, the primary rows, the output
    folder). Raises a one-line ``ConfigError`` (or ``ValueError``, ``OSError``)."""
    defaults = app_defaults(args.app.resolve())
    lr_grid = [float(v) for v in args.lr_grid.split(",") if v.strip()]
    rows = [parse_row(e, defaults, lr_grid) for e in args.methods.split(",") if e]
    if not rows:
        raise ConfigError("--methods: name at least one method, e.g. fedavg,fedper")
    labels = [r.label for r in rows]
    if any("/" in label for label in labels):
        raise ConfigError("--methods: a row label holds no '/' (it names a folder)")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--methods: a row label appears twice ({', '.join(labels)}); "
                          "tell them apart with @TAG, e.g. fedavg@lr0.1:lr=0.1")
    reference = args.reference or labels[0]
    if reference not in labels:
        raise ConfigError(f"--reference: {reference!r} is not a row ({', '.join(labels)})")
    primary = list(dict.fromkeys(filter(None, args.primary.split(",")))) or [
        label for label in labels if label != reference]
    for label in primary:
        if label not in labels or label == reference:
            raise ConfigError(f"--primary: {label!r} is not a row compared with the reference "
                              f"{reference} ({', '.join(labels)})")
    if args.tuning_seed in args.seeds and any(len(r.grid) > 1 for r in rows):
        raise ConfigError(f"--tuning-seed {args.tuning_seed} is a report seed: tuning "
                          "and reporting on the same seed favours the grids")
    base = parse_overrides(args.overrides, defaults)
    for fixed in ("method", "seed", "output-dir", "resume-from"):
        if fixed in base:
            raise ConfigError(f"{fixed}: set by the command (--methods, --seeds, --out)")
    if args.supernodes < 1:
        raise ConfigError("--supernodes: at least 1")
    if not 0 < args.validation_fraction <= 0.9:
        raise ConfigError(f"--validation-fraction: {args.validation_fraction} is out of "
                          "range; allowed: (0, 0.9]")
    out = (args.out or Path("outputs")
           / f"compare-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}").resolve()
    federation_config = LocalFederation.federation_config(
        args.supernodes, args.cpus_per_client, args.gpus_per_client)
    check_same_clients(out, args.supernodes)
    comparison = Comparison(federation, args.app.resolve(), base, out, federation_config,
                            args.run_timeout, args.validation_fraction)
    comparison.check(rows, args.seeds)
    return comparison, rows, reference, primary, out


def main(argv: Sequence[str] | None = None, federation: LocalFederation | None = None) -> int:
    """The command; ``federation``: run on this one instead of starting a warm one."""
    args = command_parser().parse_args(argv)
    command = "bash scripts/compare.sh " + " ".join(
        shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    try:
        comparison, rows, reference, primary, out = checked_comparison(args, federation)
    except (ConfigError, ValueError, OSError) as error:
        print(f"compare: {error}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "clients.json").write_text(json.dumps({"supernodes": args.supernodes}))
    print(f"[compare] {len(rows)} rows x {len(args.seeds)} seeds, written to {out}",
          flush=True)
    if len(set(budgets(rows).values())) > 1:
        print(f"[compare] unequal tuning budgets ({budget_text(rows)}): the rows with more "
              "configurations are favoured", flush=True)
    if (short := short_runs_warning(comparison.run_lengths)) is not None:
        print(f"[compare] short runs: {short}", flush=True)
    # the calling folder's modules (a user's model factory) import in every run
    with (warm_federation(pythonpath=[Path.cwd()]) if federation is None
          else contextlib.nullcontext(federation)) as comparison.federation:
        summary = compare(comparison, rows, args.seeds, args.tuning_seed, reference,
                          args.margin / 100, primary)
    print(write_report(summary, out, command))
    print(f"[compare] report: {out / 'report.md'}", flush=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
