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
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.evidence.cells import Matrix, run, select  # noqa: E402
from bench.evidence.protocol import ABLATIONS, COMMON, SCENARIOS, pool_file  # noqa: E402
from bench.evidence.report import write_report  # noqa: E402
from launch.ray_head import warm_federation  # noqa: E402


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
        with warm_federation() as federation:
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
