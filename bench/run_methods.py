"""Run several methods on one scenario through the real app and tabulate their results.json.

    python bench/run_methods.py --name digits-pathological \
        --methods fedavg,fedprox,local,fedper,fedrep,fedbn --supernodes 10 \
        partitioner='"pathological"' classes-per-client=2 num-server-rounds=20

A ``--methods`` entry is ``METHOD[@TAG][:key=value;key=value]``: the row is labelled
``METHOD@TAG`` and runs with those extra overrides (for sweeps), e.g.
``feddecomp@r0.25:feddecomp.rank-conv=0.25;feddecomp.rank-linear=0.25``.

Each method runs as ``flwr run . --stream`` on one private local SuperLink (identical data,
model, seed and evaluation for all). Writes ``bench/results/<name>.md`` (the table and the
command) and ``bench/results/<name>.json`` (every run's final numbers), and prints the table.
Seconds per round are the median over rounds 2.. (round 1 includes Ray's worker start-up;
the median resists the 2-core machine's noise).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import RESULTS, write_report
from comparison.runs import RunStore
from comparison.table import Column, in_points, markdown_table
from launch.app_project import app_defaults
from launch.compare import parse_row
from launch.federation import warm_federation
from launch.run_config import parse_overrides as launch_overrides
from strategies.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]

MB = 1024**2


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``key=value`` words as the launchers read them (``launch.run_config``)."""
    return launch_overrides(items, app_defaults(ROOT))


def same_domain_weight(results: dict[str, Any]) -> float | None:
    """Factorized-FL in the domain scenario: mean share of a client's matching weight (self
    excluded) that lands on clients of its own domain (domain = partition id mod groups);
    None where the rounds hold only the summary the server writes for many clients."""
    config = results["config"]
    similarity = next((r["similarity"] for r in reversed(results["rounds"])
                       if "similarity" in r), None)
    if similarity is None or "weights" not in similarity or config.get("partitioner") != "domain":
        return None
    groups = int(config["domain-groups"])
    clients = [int(c) for c in similarity["clients"]]
    weights = similarity["weights"]
    shares = []
    for row, k in enumerate(clients):
        others = [(w, i) for w, i in zip(weights[row], clients, strict=True) if i != k]
        total = sum(w for w, _ in others)
        if total > 0:
            shares.append(sum(w for w, i in others if i % groups == k % groups) / total)
    return sum(shares) / len(shares) if shares else None


def notes(results: dict[str, Any]) -> str:
    """Method-specific facts for the table's last column."""
    parts = []
    share = same_domain_weight(results)
    if share is not None:
        parts.append(f"same-domain weight {share:.2f}")
    analyses = [r["fedfac"] for r in results["rounds"] if "fedfac" in r]
    if analyses:
        for layer, last in analyses[-1].items():
            parts.append(f"{layer}: {last['num_shared']}/{last['num_elements']} shared")
            if "true_overlap" in last:
                parts.append(f"overlap with true {last['true_overlap']:.2f}")
        seconds = [sum(v["analysis_seconds"] for v in a.values()) for a in analyses]
        parts.append(f"FA {sum(seconds) / len(seconds) * 1000:.0f} ms/analysis")
    new = results.get("new_clients")
    if new:
        parts.append(f"new clients: LocalTrain {new['localtrain']['accuracy_mean']:.4f}, "
                     f"Ensemble {new['ensemble']['accuracy_mean']:.4f}")
    return "; ".join(parts)


def summarize(method: str, results: dict[str, Any]) -> dict[str, Any]:
    rounds = results["rounds"]
    steady = rounds[1:] or rounds
    final = results["final"]
    return {
        "method": method,
        "accuracy_weighted": final["accuracy_weighted"],
        "accuracy_mean": final["accuracy_mean"],
        "accuracy_std": final["accuracy_std"],
        "accuracy_min": final["accuracy_min"],
        "mb_up_per_round": sum(r["bytes_up"] for r in rounds) / len(rounds) / MB,
        "mb_down_per_round": sum(r["bytes_down"] for r in rounds) / len(rounds) / MB,
        "seconds_per_round": statistics.median(r["seconds"] for r in steady),
        # CPU seconds of the clients' handlers plus the server's strategy work: the method's
        # own cost per round, which (unlike wall time) other jobs on the machine barely move
        "cpu_seconds_per_round": statistics.median(
            sum(r.get("cpu_seconds", {}).values()) for r in steady),
        "server_cpu_seconds_per_round": statistics.median(
            r.get("cpu_seconds", {}).get("server", 0.0) for r in steady),
        "rounds": len(rounds),
        "notes": notes(results),
    }


# one run a row (one seed): its final accuracies in points, over clients
COLUMNS = [Column("method", lambda row: row["method"]),
           Column("accuracy weighted (points)", lambda row: in_points(row["accuracy_weighted"])),
           Column("accuracy mean (points)", lambda row: in_points(row["accuracy_mean"])),
           Column("accuracy std over clients (points)",
                  lambda row: in_points(row["accuracy_std"])),
           Column("min client (points)", lambda row: in_points(row["accuracy_min"])),
           Column("MB up/round", lambda row: f"{row['mb_up_per_round']:.4f}"),
           Column("MB down/round", lambda row: f"{row['mb_down_per_round']:.4f}"),
           Column("s/round", lambda row: f"{row['seconds_per_round']:.2f}")]
NOTES = Column("notes", lambda row: row.get("notes", ""))


def table(rows: list[dict[str, Any]]) -> str:
    """The runs' table (``comparison.table``'s writer), a notes column where a row has one."""
    return markdown_table(COLUMNS + [NOTES] * any(r.get("notes") for r in rows), rows)


def parse_entry(entry: str) -> tuple[str, str, dict[str, Any]]:
    """``METHOD[@TAG][:k=v;k=v]`` (the compare command's rows, without grids) -> (label,
    method, overrides)."""
    row = parse_row(entry, app_defaults(ROOT), [])
    if len(row.grid) != 1:
        raise SystemExit(f"{entry}: a value list (a|b) is a grid; use scripts/compare.sh")
    return row.label, row.method, row.grid[0]


def run_methods(entries: list[str], overrides: dict[str, Any], supernodes: int
                ) -> list[dict[str, Any]]:
    """Run each ``--methods`` entry on one private SuperLink (``comparison.runs``, into a
    temporary folder: always run); one summary row per run."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, warm_federation() as fed:
        store = RunStore(app_defaults(ROOT), REGISTRY, lambda config, context: fed.run(
            ROOT, config, num_supernodes=context["num_clients"]))
        for i, entry in enumerate(entries):
            label, method, extra = parse_entry(entry)
            out = Path(tmp) / f"{i}-{method}"
            config = {**overrides, **extra, "method": method, "output-dir": str(out),
                      "plot": False}
            if store.get(out.with_suffix(".json"), config, name=label,
                         context={"num_clients": supernodes}) is None:
                raise SystemExit(f"run failed: {store.failed[-1]}")
            row = summarize(label, json.loads((out / "results.json").read_text()))
            rows.append(row)
            print(f"{label}: {row['seconds_per_round']:.2f} s/round", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--methods", required=True, help="comma-separated method names")
    parser.add_argument("--supernodes", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="run-config overrides as key=value (TOML)")
    args = parser.parse_args()
    rows = run_methods(args.methods.split(","), parse_overrides(args.overrides),
                       args.supernodes)
    command = "python bench/run_methods.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_report(args.name, args.name, command, table(rows))
    (RESULTS / f"{args.name}.json").write_text(json.dumps({"command": command, "rows": rows},
                                                          indent=2))


if __name__ == "__main__":
    main()
