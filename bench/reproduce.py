"""Does today's code reproduce the evidence matrix's stored cells? One stored report cell per
method (Dirichlet 0.1 unless ``--scenario`` names another, seed 1 unless ``--seed``) runs again
as it ran: its resolved run config (the app's defaults of then) on its number of clients; its
per-round accuracy and uplink are compared with the stored ones, exactly. Where today's
matrix would run that cell differently (a default or the row's protocol changed since), the
table says how: the re-run is a replay of the stored run, not today's cell.

    python bench/reproduce.py                    # every method of the Dirichlet 0.1 scenario
    python bench/reproduce.py --only fedavg,fedfac
    python bench/reproduce.py --scenario cross-device --only fedfac@dynamic --seed 7
    python bench/reproduce.py --scenario cross-device --only factorized-fl --stage ablation

A row's cell is, of its stored report cells of that seed (ablation cells with ``--stage
ablation``, for a row whose only cells on this machine are ablations), one stored on this
machine's CPU and packages where there is one (``numerics``: only those are expected to be
identical), then the one of fewest rounds, then the first in name order. Run it before and
after a change that should not change behaviour (a refactoring), on one machine (another CPU
gives other last bits: ``bench/README.md``); the table goes to ``bench/results/reproduce.md``,
``reproduce-<scenario>[-seed<k>][-ablation].md`` for another scenario, seed or stage.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.evidence.cells import Matrix
from bench.evidence.protocol import COMMON, SCENARIOS, cell_path, pool_file
from bench.report import RESULTS, numerics, write_report
from launch.federation import warm_federation

SEED = 1
COMPARED = ("accuracy_per_round", "mb_up_per_round", "accuracy_weighted", "mb_up_total")


def stored_cell(scenario: str, label: str, seed: int = SEED, here: str = "",
                stage: str = "report", results: Path = RESULTS) -> dict | None:
    """The stored ``stage`` cell of ``label`` and ``seed`` to re-run, if any: one stored on
    ``here`` (``numerics``) first, then the one of fewest rounds."""
    folder = cell_path(results, scenario, label, stage, {}, seed).parent
    cells = [json.loads(path.read_text())
             for path in sorted(folder.glob(f"{stage}-*-seed{seed}.json"))]
    cells.sort(key=lambda cell: (cell.get("numerics") != here,
                                 cell["run_config"]["num-server-rounds"]))
    return cells[0] if cells else None


def shown(cell: dict | None) -> str:
    if cell is None:
        return "-"
    if cell.get("status") == "diverged":
        return f"diverged ({cell['reason']})"
    return f"{cell['accuracy_weighted']:.4f} / {cell['mb_up_total']:.3f} MB"


def same_run(stored: dict | None, fresh: dict | None) -> bool:
    """Whether two runs of a cell are the same to the last bit: their per-round and final
    accuracy and uplink, or, where one diverged, both diverged for the same reason."""
    if stored is None or fresh is None:
        return False
    keys = ("status", "reason") if "diverged" in (stored.get("status"), fresh.get("status")) \
        else COMPARED
    return all(stored.get(k) == fresh.get(k) for k in keys)


def verdict(same: bool, stored_on: str, here: str) -> str:
    """The table's last column: NO only where the stored cell ran on the CPU and packages the
    re-run runs on (``numerics``), a regression; a cell from another machine, or one that
    did not record where it ran, is not expected to be identical."""
    if same:
        return "yes"
    if stored_on == here:
        return "NO"
    return ("no (where it was stored is not recorded)" if stored_on == "not recorded"
            else "no, as expected of another machine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="dirichlet-0.1", choices=list(SCENARIOS))
    parser.add_argument("--only", default="", help="comma-separated labels (default: all)")
    parser.add_argument("--seed", type=int, default=SEED, help="the report seed whose cells "
                        "are re-run")
    parser.add_argument("--stage", default="report", choices=["report", "ablation"],
                        help="re-run a report cell, or an ablation cell (a row's tuned "
                        "configuration with one change)")
    parser.add_argument("--out", default="", help="keep the re-run cells here (default: a "
                        "temporary folder); a cell already there is not run again")
    args = parser.parse_args()
    scenario = args.scenario
    entries = [e for e in SCENARIOS[scenario].entries
               if not args.only or e.label in args.only.split(",")]
    common = {**COMMON, "dataset": str(pool_file())}
    lines = ["| row | configuration | stored | stored on | re-run | identical |",
             "|---|---|---|---|---|---|"]
    here = numerics()
    with tempfile.TemporaryDirectory() as tmp, warm_federation() as federation:
        fresh_matrix = Matrix(federation, common, out=Path(args.out or tmp))
        for item in entries:
            stored = stored_cell(scenario, item.label, args.seed, here, args.stage)
            if stored is None:
                continue
            fresh, today = fresh_matrix.replay(stored)
            same = same_run(stored, fresh)
            stored_on = stored.get("numerics", "not recorded")
            lines.append(f"| {item.label} | {json.dumps(stored['config'])}"
                         + (f" (today's matrix runs it with {today})" if today else "")
                         + f" | {shown(stored)} | "
                         f"{stored_on} | {shown(fresh)} | {verdict(same, stored_on, here)} |")
            print(lines[-1], flush=True)
    body = (f"Scenario {scenario}, seed {args.seed}, the stored {args.stage} cell of each row, "
            f"re-run on {here}. Identical: the per-round accuracy and uplink and the final ones "
            "are equal to the last bit; a cell stored on another CPU (its `numerics`, where it "
            "recorded them) is not expected to be (`bench/README.md`, reproducibility). Each "
            "cell re-runs as it ran (its resolved run config); where today's matrix would run "
            "it with other settings, they are named.\n\n"
            + "\n".join(lines) + "\n")
    command = "python bench/reproduce.py" + "".join(
        f" --{k} {v}" for k, v in (("scenario", scenario), ("only", args.only),
                                    ("seed", args.seed),
                                    ("stage", args.stage))
        if v and v != parser.get_default(k))
    name = ("reproduce" + ("" if scenario == parser.get_default("scenario") else f"-{scenario}")
            + ("" if args.seed == SEED else f"-seed{args.seed}")
            + ("" if args.stage == "report" else f"-{args.stage}"))
    write_report(name, "Stored matrix cells re-run", command, body)


if __name__ == "__main__":
    main()
