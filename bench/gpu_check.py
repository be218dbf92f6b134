"""The app on a CUDA GPU: a matrix cell's training, bare, on the GPU and on one CPU core, and
every paper method (and DP) through a loopback deployment whose sites train on the GPU.

    python bench/gpu_check.py --rounds 5 --deploy-rounds 3 --sites 4

- bare: ``bench/overhead.py``'s bare loop (FedAvg, no Flower) on a matrix cell's
  configuration (Dirichlet 0.1 over 20 clients of the report pool, LeNet-5, 5 local
  epochs), with ``device=cuda`` and with ``device=cpu`` at one thread (as each Ray worker of
  the matrix trains); the mean of all rounds, the first (CUDA's warm-up) included.
- deployment: ``flower-superlink`` plus ``--sites`` ``pflower-supernode`` sites
  (``launch/deployment.py``: each site's ClientApps forked warm, CUDA initialised in each
  child), ``device=cuda`` in the run config, so a client that cannot train on the GPU fails
  its run (``client_app/runtime.py: select_device``). One run per method, plus FedDecomp
  with central DP and FedPer with local DP. No Ray: a simulation is not run here.

Writes ``bench/results/gpu-check.md`` (and ``$OUT/gpu-check.md`` where ``OUT`` is set).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.evidence.protocol import COMMON, SCENARIOS, pool_file
from bench.overhead import bare_loop
from bench.report import RESULTS, machine, write_report
from launch.deployment import LocalDeployment

ROOT = Path(__file__).resolve().parents[1]

DEPLOYED = [("fedavg", {}), ("fedper", {}), ("feddecomp", {}), ("fedfac", {}),
            ("factorized-fl", {}), ("pfedc", {}),
            ("feddecomp", {"dp.mode": "central", "dp.noise-multiplier": 0.5,
                           "dp.clip-norm": 1.0}),
            ("fedper", {"dp.mode": "local", "dp.noise-multiplier": 0.5, "dp.clip-norm": 1.0})]


def bare_rows(config: dict, clients: int, rounds: int, gpu: str) -> list[str]:
    rows = []
    for device, threads in ((gpu, None), ("cpu", 1))[gpu == "cpu":]:
        if threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        seconds = bare_loop({**config, "device": device}, clients, rounds)
        wall = time.perf_counter() - start
        rows.append(f"| bare loop, {device}{f' ({threads} thread)' if threads else ''} | "
                    f"{wall:.1f} s | {sum(seconds) / rounds:.2f} s |")
        print(rows[-1], flush=True)
    return rows


def deployed_rows(config: dict, sites: int, rounds: int, device: str) -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, \
            LocalDeployment(num_sites=sites, supernode="pflower-supernode") as deployment:
        for method, extra in DEPLOYED:
            out = Path(tmp) / f"{method}-{len(rows)}"
            run_config = {**config, "method": method, "num-server-rounds": rounds,
                          "device": device, "output-dir": str(out), **extra}
            start = time.perf_counter()
            run = deployment.run(ROOT, run_config, timeout=600)
            wall = time.perf_counter() - start
            label = method + "".join(f" {k}={v}" for k, v in extra.items())
            if not run.ok:
                rows.append(f"| {label} | failed ({run.status}) | | | |")
                print(run.output[-4000:], flush=True)
            else:
                results = json.loads((out / "results.json").read_text())
                per_round = [r["seconds"] for r in results["rounds"]]
                epsilon = (results["final"].get("privacy") or {}).get("epsilon")
                rows.append(f"| {label} | completed | {wall:.1f} s | "
                            f"{sum(per_round) / len(per_round):.2f} s | "
                            f"{results['final']['accuracy_weighted']:.4f}"
                            f"{f' (epsilon {epsilon:.1f})' if epsilon else ''} |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="bare loop rounds")
    parser.add_argument("--deploy-rounds", type=int, default=3)
    parser.add_argument("--sites", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    args = parser.parse_args()
    config = {**COMMON, **SCENARIOS["dirichlet-0.1"].config, "lr": 0.01, "plot": False,
              "dataset": str(pool_file())}
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device is visible")
    print(machine(), flush=True)
    bare = bare_rows(config, 20, args.rounds, args.device)
    deployed = deployed_rows({**config, "num-server-rounds": args.deploy_rounds}, args.sites,
                             args.deploy_rounds, args.device)
    body = (f"On {machine()}.\n\n"
            f"A matrix cell's training ({args.rounds} rounds, 20 clients, FedAvg, no Flower):\n\n"
            "| how | wall time | a round |\n|---|---|---|\n" + "\n".join(bare) + "\n\n"
            f"Each method through a loopback deployment ({args.sites} `pflower-supernode` "
            f"sites, `device={args.device}`, {args.deploy_rounds} rounds):\n\n"
            "| run | outcome | wall time | a round | accuracy (weighted) |\n"
            "|---|---|---|---|---|\n" + "\n".join(deployed) + "\n")
    command = (f"python bench/gpu_check.py --rounds {args.rounds} --deploy-rounds "
               f"{args.deploy_rounds} --sites {args.sites}")
    name = "gpu-check" if args.device != "cpu" else "gpu-check-dry-run"
    write_report(name, "The app on a CUDA GPU", command, body)
    if os.environ.get("OUT"):
        shutil.copy(RESULTS / f"{name}.md", Path(os.environ["OUT"]) / f"{name}.md")
    if any("failed" in row for row in deployed):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
