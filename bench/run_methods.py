"""Run several methods on one scenario through the real app and tabulate their results.json.

    python bench/run_methods.py --name digits-pathological \
        --methods fedavg,fedprox,local,fedper,fedrep,fedbn --supernodes 10 \
        partitioner='"pathological"' classes-per-client=2 num-server-rounds=20

Each method runs as ``flwr run . --stream`` on one private local SuperLink (identical data,
model, seed and evaluation for all). Writes ``bench/results/<name>.md`` (the table and the
command) and ``bench/results/<name>.json`` (every run's final numbers), and prints the table.
Seconds per round are the mean over rounds 2.. (round 1 includes Ray's worker start-up).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.local_federation import LocalFederation  # noqa: E402

MB = 1024**2


def parse_overrides(items: list[str]) -> dict[str, Any]:
    return tomllib.loads("\n".join(f'"{k}" = {v}' for k, v in
                                   (item.split("=", 1) for item in items)))


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
        "seconds_per_round": sum(r["seconds"] for r in steady) / len(steady),
        "rounds": len(rounds),
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = ("| method | acc weighted | acc mean | acc std | acc min | MB up/round "
              "| MB down/round | s/round |\n|---|---|---|---|---|---|---|---|\n")
    return header + "".join(
        f"| {r['method']} | {r['accuracy_weighted']:.4f} | {r['accuracy_mean']:.4f} | "
        f"{r['accuracy_std']:.4f} | {r['accuracy_min']:.4f} | {r['mb_up_per_round']:.3f} | "
        f"{r['mb_down_per_round']:.3f} | {r['seconds_per_round']:.2f} |\n" for r in rows)


def run_methods(methods: list[str], overrides: dict[str, Any], supernodes: int,
                labels: list[str] | None = None, federation: LocalFederation | None = None,
                ) -> list[dict[str, Any]]:
    """Run each method (``labels`` name the rows; a label may carry its own overrides as
    ``label=method:key=value,...``) and return one summary row per run."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp, (
            federation or LocalFederation()) as fed:
        for i, method in enumerate(methods):
            label = labels[i] if labels else method
            out = Path(tmp) / f"{i}-{method}"
            config = {**overrides, "method": method, "output-dir": str(out), "plot": False}
            run = fed.run(ROOT, config, num_supernodes=supernodes)
            if not run.ok:
                print(run.output[-4000:], file=sys.stderr)
                raise SystemExit(f"{label}: run failed ({run.status})")
            results = json.loads((out / "results.json").read_text())
            row = summarize(label, results)
            rows.append(row)
            print(f"{label}: acc weighted {row['accuracy_weighted']:.4f} "
                  f"min {row['accuracy_min']:.4f} | {row['seconds_per_round']:.2f} s/round",
                  flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--methods", required=True, help="comma-separated method names")
    parser.add_argument("--supernodes", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="run-config overrides as key=value (TOML)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    rows = run_methods(methods, parse_overrides(args.overrides), args.supernodes)
    command = "python bench/run_methods.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    table = markdown_table(rows)
    out_dir = ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{args.name}.md").write_text(
        f"# {args.name}\n\n```\n{command}\n```\n\n{table}")
    (out_dir / f"{args.name}.json").write_text(json.dumps(
        {"command": command, "rows": rows}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
