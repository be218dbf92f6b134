"""The evidence matrix: every method on Fashion-MNIST scenarios, tuned on one seed, reported
on ten others, with one report and its plots. Protocol v4 writes to
``bench/results/matrix-v4/`` (``report.md``; ``matrix/`` its cells, plots and
``summary.json``), apart from v3's (``bench/results/report.md``, ``bench/results/matrix/``),
which stay the published evidence until v4 is complete and which this command never writes.

    python bench/matrix.py                        # the whole matrix: tune, then report; resumes
    python bench/matrix.py --stage tune --scenarios dirichlet-0.1  # searches and rounds only
    python bench/matrix.py --ablations            # only the ablations of tuned rows
    python bench/matrix.py --privacy              # only the DP cells of tuned rows
    python bench/matrix.py --write-only           # rewrite v4's report and plots from its cells

Every run is one cell (its summary and per-round series), stored as
``bench/results/matrix-v4/matrix/cells/<scenario>/<label>/<stage>-<config>-seed<k>.json``; a
cell that exists is not run again, so the command resumes where it stopped; a v3 cell of the
same run whose configuration, rounds, data and number of clients are today's is taken over
instead of run (``Matrix.take_over``; marked ``reused_from``). The report is always written from
all cells present. The protocol (``bench/evidence/protocol.py``, bench/README.md "The evidence
matrix"):

- data: ``POOL_SIZE`` images drawn (``numpy`` seed 0) from Fashion-MNIST's 60,000 training
  images in the real IDX files (``bench.data.ensure_dataset``), each scenario's clients
  (``SCENARIOS``) keeping ``test-fraction`` of their share as their personal test split; the
  same model (LeNet-5), local epochs, batch size and evaluation for every method
  (``COMMON``);
- search, on seed ``TUNING_SEED``, the same for every row: its defaults at every learning
  rate of ``LR_GRID`` (and past its end while the best is there, ``next_learning_rate``),
  then at the best one the rest of ``EXTRA_CONFIGS`` (the method's own ``SETTINGS``, each
  keeping the paper's mechanism, then ``COMMON_KNOBS``, which keep a round's computation);
  each tuning run reads the tuning pool (disjoint from the report pool) and is scored on
  validation splits (``TUNING``); the configuration with the best mean of its last 5 rounds
  of validation accuracy is kept;
- rounds: one count R a scenario, from every row's tuning run at its chosen configuration at
  the base rounds and, while one has not converged on validation, at twice them, at most
  ``MAX_DOUBLINGS`` times (``bench/evidence/rounds.py``), before any report seed runs;
- report: the kept configuration at R on seeds ``REPORT_SEEDS`` (ten, every row, every claim);
  mean and standard deviation over seeds of each run's last-5-round accuracy (never the best
  round), at R and at the base rounds (the run's prefix), its unstable seeds, its slope, the
  lowest client, the task accuracy, uplink and seconds; each claim judged on the per-seed
  paired difference, the primary ones with Holm's correction (``bench/evidence/claims.py``);
  each scenario's pick (``bench/evidence/pick.py``); ``summary.json`` beside the report. With
  ``--stage report`` a row whose search is incomplete, or a scenario whose rounds are not
  fixed, reports its defaults at the base rounds and is marked so; the whole matrix runs no
  report seed for it;
- ablations (``ABLATIONS``, run after the rows): a row's tuned configuration with one
  change at R, on the exploratory seeds: where a claim did not hold, to show why, a paper
  method's mechanism turned off, and FedFac's random split of the same size, the reference
  its split claim is judged against (on every report seed);
- privacy (``PRIVACY``, last): six rows at their tuned configuration and their scenario's
  base rounds under local DP at three noise multipliers, on the exploratory seeds, against
  FedAvg and FedPer at the same noise multiplier (``bench/evidence/privacy.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.evidence.cells import Matrix, run, select
from bench.evidence.protocol import (
    ABLATIONS,
    COMMON,
    PRIVACY,
    SCENARIOS,
    TUNING,
    cells_folder,
    pool_file,
    results_folder,
)
from bench.evidence.report import write_report
from bench.report import RESULTS
from client_app.runtime import EXACT_EVALUATION_ENV
from launch.federation import warm_federation

# v4's own folder; the runs' output folders under v3's, which git ignores; v3's cells are the
# ones a v4 cell of the same run is taken over from
OUT, RUNS = results_folder(RESULTS), RESULTS / "matrix" / "runs" / "v4"


def has_cells(out: Path, device: str) -> bool:
    """Whether any cell of this protocol is stored under ``out`` for ``device``."""
    return any((out / "matrix" / cells_folder(device)).rglob("*.json"))


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
            matrix = Matrix(federation, common, out=OUT, tuning=tuning, runs=RUNS,
                            reuse=RESULTS)
            whole = not only and args.stage == "all" and not (args.ablations or args.privacy)
            if not (args.ablations or args.privacy):
                run(matrix, select(args.scenarios.split(","), only), args.stage)
            if args.ablations or whole:
                for ablation in ABLATIONS:  # the whole matrix ends with them, then privacy
                    if ablation.scenario in args.scenarios.split(","):
                        matrix.ablation(ablation)
            if args.privacy or whole:
                for entry in PRIVACY:
                    if entry.scenario in args.scenarios.split(","):
                        matrix.privacy(entry)
    if not has_cells(OUT, args.device):
        # nothing of v4 yet: say so, and leave v3's report, the published one, as it is
        sys.exit(f"no protocol v4 cells under {OUT / 'matrix' / cells_folder(args.device)}: "
                 "no report written; v3's "
                 "(bench/results/report.md, bench/results/matrix/summary.json) is unchanged")
    print(write_report(Matrix(None, common, out=OUT, tuning=tuning, runs=RUNS), command))


if __name__ == "__main__":
    main()
