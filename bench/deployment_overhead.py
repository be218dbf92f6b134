"""Seconds per round of the same method in simulation and in a loopback deployment.

    python bench/deployment_overhead.py --rounds 4 --sites 3

Simulation: ``flwr run`` on a private simulation SuperLink (Ray workers stay up between
messages). Deployment: ``flower-superlink`` + ``--sites`` ``flower-supernode`` processes on
loopback (``common/local_deployment.py``), where every message starts a fresh
``flwr-clientapp`` process (Python, torch and the app are imported again) and the ServerApp's
grid polls for replies every 3 s. Writes bench/results/deployment_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_report  # noqa: E402
from common.local_deployment import LocalDeployment  # noqa: E402
from common.local_federation import LocalFederation  # noqa: E402


def measure(runtime, config: dict, out: Path, **kwargs) -> tuple[float, list[float]]:
    start = time.perf_counter()
    run = runtime.run(ROOT, {**config, "output-dir": str(out)}, **kwargs)
    wall = time.perf_counter() - start
    if not run.ok:
        raise SystemExit(run.output[-3000:])
    return wall, [r["seconds"] for r in json.loads((out / "results.json").read_text())["rounds"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--method", default="fedper")
    args = parser.parse_args()
    config = {"method": args.method, "num-server-rounds": args.rounds, "plot": False,
              "min-nodes": args.sites}
    with tempfile.TemporaryDirectory() as tmp:
        with LocalFederation() as federation:
            sim_wall, sim = measure(federation, config, Path(tmp) / "sim",
                                    num_supernodes=args.sites)
        with LocalDeployment(args.sites) as deployment:
            dep_wall, dep = measure(deployment, config, Path(tmp) / "dep")
    steady_sim, steady_dep = statistics.median(sim[1:]), statistics.median(dep[1:])
    table = ("| runtime | wall time (whole run) | round 1 | median round 2.. |\n"
             "|---|---|---|---|\n"
             f"| simulation (Ray) | {sim_wall:.1f} s | {sim[0]:.1f} s | {steady_sim:.2f} s |\n"
             f"| loopback deployment | {dep_wall:.1f} s | {dep[0]:.1f} s | "
             f"{steady_dep:.2f} s |\n"
             f"| ratio | {dep_wall / sim_wall:.1f}x | | {steady_dep / steady_sim:.1f}x |\n")
    command = (f"python bench/deployment_overhead.py --rounds {args.rounds} "
               f"--sites {args.sites} --method {args.method}")
    write_report("deployment_overhead", f"Simulation vs loopback deployment ({args.method}, "
                 f"digits, {args.sites} sites)", command, table)


if __name__ == "__main__":
    main()
