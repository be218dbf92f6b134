"""Round time of methods against a baseline, measured in interleaved repeats.

    python bench/round_time.py --name round-time-pfedc --baseline fedavg \
        --methods 'pfedc@no-mgda:pfedc.mgda=false,pfedc' --repeats 3 --supernodes 10 \
        partitioner='"pathological"' classes-per-client=2 num-server-rounds=12

One shared 2-core machine drifts by tens of percent between minutes, so a single run per
method says little. Here every repeat runs the baseline and each method back to back (the
order rotates from repeat to repeat) through ``bench/run_methods.py``'s runner, and each
method's round time is divided by the baseline's from the same repeat. A run's round time is
the median over rounds 2.. (round 1 includes Ray's worker start-up). Beside wall time it
reports CPU seconds per round (``cpu_seconds`` in results.json: the clients' train and evaluate
handlers plus the server's strategy work), the method's own cost, which steal time and other
jobs barely move. Per method: each repeat's value and the median and range of the ratios.
Writes ``bench/results/<name>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from typing import Any

from bench.report import RESULTS, write_report
from bench.run_methods import parse_entry, parse_overrides, run_methods


def interleaved(baseline: str, methods: list[str], repeats: int) -> list[str]:
    """Repeat ``r`` runs the baseline and the methods, rotated by ``r`` places."""
    entries = [baseline, *methods]
    return [entries[(r + i) % len(entries)] for r in range(repeats)
            for i in range(len(entries))]


def ratios(rows: list[dict[str, Any]], baseline: str, labels: list[str], repeats: int
           ) -> list[dict[str, Any]]:
    """Per label and repeat: wall and CPU s/round, and their ratios to the same repeat's
    baseline."""
    per_repeat = len(rows) // repeats
    table = []
    for label in [baseline, *labels]:
        row: dict[str, Any] = {"method": label, "notes": next(
            x for x in rows if x["method"] == label)["notes"]}
        for key in ("seconds_per_round", "cpu_seconds_per_round",
                    "server_cpu_seconds_per_round"):
            row[key], row[f"{key}_ratio"] = [], []
            for r in range(repeats):
                chunk = rows[r * per_repeat:(r + 1) * per_repeat]
                own = next(x for x in chunk if x["method"] == label)[key]
                base = next(x for x in chunk if x["method"] == baseline)[key]
                row[key].append(own)
                row[f"{key}_ratio"].append(own / base if base else float("nan"))
        table.append(row)
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    lines = ["| method | wall s/round per repeat | wall ratio (median, range) "
             "| CPU s/round per repeat | CPU ratio (median, range) | server CPU s/round "
             "| notes |", "|---|---|---|---|---|---|---|"]

    def ratio(values: list[float]) -> str:
        return (f"{statistics.median(values):.2f}x ({min(values):.2f}x-{max(values):.2f}x)")

    for row in table:
        lines.append(
            f"| {row['method']} | "
            + ", ".join(f"{s:.3f}" for s in row["seconds_per_round"])
            + f" | {ratio(row['seconds_per_round_ratio'])} | "
            + ", ".join(f"{s:.3f}" for s in row["cpu_seconds_per_round"])
            + f" | {ratio(row['cpu_seconds_per_round_ratio'])} | "
            f"{statistics.median(row['server_cpu_seconds_per_round']):.3f} | {row['notes']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--baseline", default="fedavg")
    parser.add_argument("--methods", required=True, help="comma-separated run_methods entries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--supernodes", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="run-config overrides as key=value (TOML)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    rows = run_methods(interleaved(args.baseline, methods, args.repeats),
                       parse_overrides(args.overrides), args.supernodes)
    table = ratios(rows, parse_entry(args.baseline)[0],
                   [parse_entry(m)[0] for m in methods], args.repeats)
    command = "python bench/round_time.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_report(args.name, args.name, command, markdown(table))
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "table": table, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
