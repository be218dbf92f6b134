"""Seconds per round in a loopback deployment and in simulation, and where they go.

    python bench/deployment_overhead.py --rounds 6 --sites 3 --method fedper

Runs the same config (digits) as ``flwr run`` in simulation (Ray workers stay up between
messages) and on a loopback deployment (``flower-superlink`` + ``--sites``
``flower-supernode`` processes, ``launch/deployment.py``, where every message starts a
fresh ``flwr-clientapp`` process), each with fused evaluation (one exchange a round, the
default) and with the two-exchange protocol; and on the same deployment Flower's floor, a
minimal app whose ClientApp imports PyTorch and replies at once (``bench/floor_app``,
through plain ``flower-supernode``), and the config through ``pflower-supernode`` (each
site's ClientApps forked warm, ``launch/site.py``). Per round it reports the wall time and the
breakdown that ``results.json`` records: the server's wait per exchange, and per client
message the means of process start-up and imports, setup (run config, model), data loading,
training and evaluation. It also times ``import client_app.app`` in fresh interpreters
(``python -X importtime``, the median of ``--import-repeats``) with its largest parts.
Writes ``bench/results/deployment_overhead.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import RESULTS, write_report
from launch.deployment import LocalDeployment
from launch.federation import LocalFederation

ROOT = Path(__file__).resolve().parents[1]

PHASES = ("startup", "setup", "data", "train", "evaluate")


def import_seconds(repeats: int) -> tuple[float, list[tuple[str, float]]]:
    """Median wall seconds of ``import client_app.app`` in a fresh interpreter, and the
    largest top-level contributors of the median run (module, seconds)."""
    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, "-X", "importtime", "-c",
                               "import client_app.app"], cwd=ROOT, capture_output=True,
                              text=True, check=True)
        rows = []
        for line in done.stderr.splitlines():
            if not line.startswith("import time:") or "|" not in line:
                continue
            _, cumulative, name = line.split("|")
            depth = (len(name) - len(name.lstrip()) - 1) // 2  # nesting, from the indent
            if cumulative.strip().isdigit():
                rows.append((name.strip(), int(cumulative) / 1e6, depth))
        total = next(s for n, s, _ in rows if n == "client_app.app")
        top = sorted(((n, s) for n, s, depth in rows if depth <= 1), key=lambda r: -r[1])
        runs.append((total, top))
    runs.sort(key=lambda r: r[0])
    total, top = runs[len(runs) // 2]
    return total, [r for r in top if r[0] != "client_app.app"][:6]


def breakdown(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over rounds 2..: wall, server wait per round, and per-message phase means."""
    steady = rounds[1:] or rounds
    out = {"round_seconds": statistics.median(r["seconds"] for r in steady),
           "wait_seconds": statistics.median(sum(r.get("exchange_seconds", [0.0]))
                                             for r in steady),
           "exchanges": statistics.median(len(r.get("exchange_seconds", [])) for r in steady)}
    for phase in PHASES:
        means = []
        for r in steady:
            stages = r.get("client_seconds", {}).values()
            messages = sum(s["messages"] for s in stages)
            if messages:
                means.append(sum(s.get(phase, 0.0) for s in stages) / messages)
        out[phase] = statistics.median(means) if means else 0.0
    return out


def measure(runtime, config: dict, out: Path, **kwargs) -> dict[str, Any]:
    start = time.perf_counter()
    run = runtime.run(ROOT, {**config, "output-dir": str(out)}, **kwargs)
    wall = time.perf_counter() - start
    if not run.ok:
        raise SystemExit(run.output[-3000:])
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    return {"wall": wall, "rounds": [r["seconds"] for r in rounds], **breakdown(rounds),
            "accuracy": rounds[-1]["eval"]["accuracy_weighted"]}


def floor_rounds(sites: int, rounds: int, out: Path) -> dict[str, Any]:
    """Flower's floor on the deployment: the floor app's rounds through plain
    ``flower-supernode`` (its ServerApp times each round's send and receive)."""
    with LocalDeployment(sites) as deployment:
        start = time.perf_counter()
        run = deployment.flwr_run(ROOT / "bench" / "floor_app",
                                  {"num-server-rounds": rounds, "min-nodes": sites,
                                   "output-dir": str(out)}, [], timeout=600)
        wall = time.perf_counter() - start
    if not run.ok:
        raise SystemExit(run.output[-3000:])
    seconds = json.loads((out / "floor.json").read_text())["round_seconds"]
    return {"wall": wall, "rounds": seconds,
            "round_seconds": statistics.median(seconds[1:] or seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--method", default="fedper")
    parser.add_argument("--import-repeats", type=int, default=5)
    args = parser.parse_args()
    config = {"method": args.method, "num-server-rounds": args.rounds, "plot": False,
              "min-nodes": args.sites}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        floor = floor_rounds(args.sites, args.rounds, Path(tmp) / "floor")
        with LocalDeployment(args.sites, supernode="pflower-supernode") as deployment:
            rows["deployment, fused, pflower-supernode (warm ClientApps)"] = measure(
                deployment, {**config, "fused-evaluation": True}, Path(tmp) / "dep-warm")
        for fused in (True, False):
            label = "fused" if fused else "two exchanges"
            setting = {**config, "fused-evaluation": fused}
            with LocalDeployment(args.sites) as deployment:
                rows[f"deployment, {label}"] = measure(
                    deployment, setting, Path(tmp) / f"dep-{fused}")
            if fused:  # the sites' threads: shared out (the default) or PyTorch's own
                with LocalDeployment(args.sites, site_threads=0) as deployment:
                    rows[f"deployment, {label}, PyTorch's default threads"] = measure(
                        deployment, setting, Path(tmp) / "dep-default-threads")
                # each SuperExec looks for new work every 0.2 s (the default here) or 1 s
                # (Flower's default, FLWR_SUPEREXEC_TASK_POLL_INTERVAL)
                with LocalDeployment(args.sites, poll_interval=1.0) as deployment:
                    rows[f"deployment, {label}, SuperExec poll 1 s"] = measure(
                        deployment, setting, Path(tmp) / "dep-poll-1s")
            with LocalFederation() as federation:
                rows[f"simulation, {label}"] = measure(
                    federation, setting, Path(tmp) / f"sim-{fused}", num_supernodes=args.sites)
    imports, top = import_seconds(args.import_repeats)
    lines = ["| runtime | whole run | median round 2.. | exchanges | server wait | "
             "per message: start-up+imports | setup | data | train | evaluate | final acc |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['wall']:.1f} s | **{r['round_seconds']:.2f} s** | "
                     f"{r['exchanges']:.0f} | {r['wait_seconds']:.2f} s | "
                     f"{r['startup']:.2f} s | {r['setup']:.2f} s | {r['data']:.3f} s | "
                     f"{r['train']:.2f} s | {r['evaluate']:.3f} s | {r['accuracy']:.4f} |")
    warm = rows["deployment, fused, pflower-supernode (warm ClientApps)"]["round_seconds"]
    lines += ["", f"Flower's floor on the same deployment (`bench/floor_app`: a ClientApp that "
              f"imports PyTorch and replies at once, plain `flower-supernode`): "
              f"**{floor['round_seconds']:.2f} s** a round (median of rounds 2..; every "
              f"round: {', '.join(f'{x:.2f}' for x in floor['rounds'])} s). {args.method} "
              f"through `pflower-supernode`: **{warm / floor['round_seconds']:.2f}x** the "
              "floor's round."]
    lines += ["", f"`import client_app.app` in a fresh interpreter: **{imports:.2f} s** "
              f"(median of {args.import_repeats}); largest parts: "
              + ", ".join(f"`{n}` {s:.2f} s" for n, s in top) + "."]
    command = (f"python bench/deployment_overhead.py --rounds {args.rounds} "
               f"--sites {args.sites} --method {args.method}")
    write_report("deployment_overhead", f"Round time: loopback deployment vs simulation "
                 f"({args.method}, digits, {args.sites} sites)", command,
                 "\n".join(lines) + "\n")
    (RESULTS / "deployment_overhead.json").write_text(json.dumps(
        {"command": command, "runs": rows, "floor": floor, "import_seconds": imports,
         "import_top": top},
        indent=2))


if __name__ == "__main__":
    main()
