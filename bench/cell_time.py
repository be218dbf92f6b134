"""The evidence matrix's time per cell, cold (before warm runs) and warm (as it runs now).

    python bench/cell_time.py --cells 2

The first ``--cells`` cells stored under bench/results/matrix/cells (sorted by path) are run
again, each twice and interleaved, into a temporary folder (the stored cells are not
touched):

- cold: its own SuperLink and a private Ray instance started and stopped with the run, as
  each cell ran before ``launch/ray_head.py``;
- warm: as ``bench/matrix.py`` runs them (``launch.federation.warm_federation``: one
  SuperLink, Ray head and fork server kept up between the runs, each run's Ray workers
  started during the run before); a first warm run, left out, starts the head's workers.

Per cell: wall seconds of each, the sum of its rounds' seconds (``results.json``) and the
fixed cost, wall minus rounds. Both runs of a cell must give the same accuracy (same seed).
Writes ``bench/results/cell_time.md``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.overhead import timed_run
from bench.report import RESULTS, write_report
from launch.federation import LocalFederation, warm_federation

CELL_TIMEOUT = 1800  # seconds, as bench/evidence/cells.py gives a cell


def final_accuracy(out: Path) -> float:
    return json.loads((out / "results.json").read_text())["final"]["accuracy_weighted"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=2)
    args = parser.parse_args()
    # a diverged cell (an ablation's, a search's) stops early and has no accuracy to compare
    stored = {path: json.loads(path.read_text())
              for path in sorted((RESULTS / "matrix" / "cells").rglob("*.json"))}
    paths = [path for path, cell in stored.items() if cell.get("status") != "diverged"]
    cells = [stored[path] for path in paths[:args.cells]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, warm_federation() as warm:
        first = cells[0]
        timed_run(warm, first["run_config"], first["num_clients"], Path(tmp) / "warm-up",
                  CELL_TIMEOUT)
        for k, cell in enumerate(cells):
            config, clients = cell["run_config"], cell["num_clients"]
            cold_out, warm_out = Path(tmp) / f"cold-{k}", Path(tmp) / f"warm-{k}"
            with LocalFederation() as cold:
                cold_run = timed_run(cold, config, clients, cold_out, CELL_TIMEOUT)
            warm_run = timed_run(warm, config, clients, warm_out, CELL_TIMEOUT)
            # same seed, same run
            assert final_accuracy(cold_out) == final_accuracy(warm_out), (cold_run, warm_run)
            rows.append((paths[k].relative_to(RESULTS / "matrix" / "cells"), clients,
                         config["num-server-rounds"], cold_run, warm_run))
    lines = ["| cell | clients, rounds | cold: wall / rounds / fixed (s) "
             "| warm: wall / rounds / fixed (s) | warm / cold wall |", "|---|---|---|---|---|"]
    for name, clients, rounds, cold_run, warm_run in rows:
        lines.append(f"| `{name}` | {clients}, {rounds} | {cold_run[0]:.1f} / {cold_run[1]:.1f} "
                     f"/ {cold_run[0] - cold_run[1]:.1f} | {warm_run[0]:.1f} / "
                     f"{warm_run[1]:.1f} / {warm_run[0] - warm_run[1]:.1f} | "
                     f"{warm_run[0] / cold_run[0]:.2f} |")
    write_report("cell_time", "The evidence matrix's time per cell, cold and warm",
                 f"python bench/cell_time.py --cells {args.cells}",
                 "\n".join(lines) + "\n\nBoth runs of each cell give the same final accuracy "
                 "(checked). Fixed cost: wall time minus the sum of the rounds' seconds.\n")


if __name__ == "__main__":
    main()
