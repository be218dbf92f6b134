"""The evidence matrix: every method on Fashion-MNIST scenarios, tuned on one seed, reported
on five others, with one report (``bench/results/report.md``) and its plots.

    python bench/matrix.py                        # the whole matrix: tune, then report; resumes
    python bench/matrix.py --stage report --scenarios dirichlet-0.1 --only fedavg,feddecomp
    python bench/matrix.py --ablations            # only the ablations of tuned rows
    python bench/matrix.py --privacy              # only the DP cells of tuned rows
    python bench/matrix.py --write-only           # rewrite report.md and plots from the cells

Every run is one cell (its summary and per-round series), stored as
``bench/results/matrix/cells/<scenario>/<label>/<stage>-<config>-seed<k>.json``; a cell
that exists is not run again, so the command resumes where it stopped, and the report is
always written from all cells present (plots in ``bench/results/matrix/``). The protocol
(``bench/evidence/protocol.py``, bench/README.md "The evidence matrix"):

- data: ``POOL_SIZE`` images drawn (``numpy`` seed 0) from Fashion-MNIST's 60,000 training
  images in the real IDX files (``bench.data.ensure_dataset``), each scenario's clients
  (``SCENARIOS``) keeping ``test-fraction`` of their share as their personal test split; the
  same model (LeNet-5), rounds, local epochs, batch size and evaluation for every method
  (``COMMON``);
- search, on seed ``TUNING_SEED``, the same for every row: its defaults at every learning
  rate of ``LR_GRID`` (and past its end while the best is there, ``next_learning_rate``),
  then at the best one the rest of ``EXTRA_CONFIGS`` (the method's own ``SETTINGS``, then
  ``COMMON_KNOBS``); each tuning run reads the tuning pool (disjoint from
  the report pool) and is scored on validation splits (``TUNING``); the configuration with
  the best mean of its last 5 rounds of validation accuracy is kept;
- report: the kept configuration on seeds ``REPORT_SEEDS``; mean and standard deviation over
  seeds of each run's last-5-round accuracy (never the best round), its slope, the lowest
  client, the task accuracy, uplink and seconds; each claim judged on the per-seed paired
  difference (``bench/evidence/claims.py``); ``bench/results/matrix/summary.json`` beside the
  report. With ``--stage report`` a row whose search is incomplete reports its defaults and
  is marked so; the whole matrix runs no report seed for it;
- more seeds (``EXTRA_SEEDS``) for the rows and references of a claim whose interval lies
  across its margin after the report seeds, once (``bench/evidence/claims.py``);
- ablations (``ABLATIONS``, run after the rows): a row's tuned configuration with one
  change, on the same report seeds: where a claim did not hold, to show why, and FedFac's
  random split of the same size, the reference its split claim is judged against;
- privacy (``PRIVACY``, last): six rows at their tuned configuration and their scenario's
  rounds under local DP at three noise multipliers, on the report seeds, against FedAvg and
  FedPer at the same noise multiplier (``bench/evidence/privacy.py``).
"""

from __future__ import annotations

import argparse
import os

from bench.evidence import protocol
from bench.evidence.cells import Matrix, row_entry, run, select
from bench.evidence.claims import undecided
from bench.evidence.protocol import (
    ABLATIONS,
    COMMON,
    PRIVACY,
    SCENARIOS,
    TUNING,
    pool_file,
)
from bench.evidence.report import judged, write_report
from client_app.runtime import EXACT_EVALUATION_ENV
from launch.federation import warm_federation


def run_extra_seeds(matrix: Matrix, scenarios: list[str]) -> None:
    """The rule for undecided claims (``bench/evidence/claims.py``): their rows and references
    on ``EXTRA_SEEDS`` too, once."""
    *_, claims = judged(matrix)
    for scenario, label in sorted(undecided(claims)):
        if scenario not in scenarios:
            continue
        item = row_entry(scenario, label)
        config, _ = matrix.reported(scenario, item)
        for seed in protocol.EXTRA_SEEDS:
            matrix.cell(scenario, item, "report", config, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma-separated, default all")
    parser.add_argument("--only", default="",
                        help="comma-separated labels, methods or scenario/label")
    parser.add_argument("--stage", choices=("all", "tune", "report"), default="all",
                        help="report alone runs untuned rows on their defaults")
    parser.add_argument("--device", default="auto",
                        help="the app's device key for every run (cuda on a GPU machine); "
                        "cells are kept per device")
    parser.add_argument("--write-only", action="store_true", help="no runs, only the report")
    parser.add_argument("--ablations", action="store_true",
                        help="run the ablations of tuned rows (ABLATIONS), then the report")
    parser.add_argument("--privacy", action="store_true",
                        help="run the DP cells of tuned rows (PRIVACY), then the report")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not args.write_only:
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: no CUDA device is visible on this machine")
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    common = {**COMMON, "dataset": str(pool_file()),
              **({"device": args.device} if args.device != "auto" else {})}
    tuning = {**TUNING, "dataset": str(pool_file(role="tuning"))}
    command = "python bench/matrix.py" + (f" --device {args.device}"
                                          if args.device != "auto" else "")
    only = [o for o in args.only.split(",") if o]
    if not args.write_only:
        # the matrix's simulated sites are the benchmark's own: under local DP they send their
        # exact scores, so that a privacy row's accuracy is the model's, not a noised figure
        # (client_app/runtime.py: Client.released)
        os.environ[EXACT_EVALUATION_ENV] = "1"
        with warm_federation() as federation:
            matrix = Matrix(federation, common, tuning=tuning)
            whole = not only and args.stage == "all" and not (args.ablations or args.privacy)
            if not (args.ablations or args.privacy):
                run(matrix, select(args.scenarios.split(","), only), args.stage)
                if args.stage != "tune":
                    run_extra_seeds(matrix, args.scenarios.split(","))
            if args.ablations or whole:
                for ablation in ABLATIONS:  # the whole matrix ends with them, then privacy
                    if ablation.scenario in args.scenarios.split(","):
                        matrix.ablation(ablation)
            if args.privacy or whole:
                for entry in PRIVACY:
                    if entry.scenario in args.scenarios.split(","):
                        matrix.privacy(entry)
    print(write_report(Matrix(None, common, tuning=tuning), command))


if __name__ == "__main__":
    main()
