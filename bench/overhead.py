"""A run's fixed cost, cold and warm, and the app's overhead against a bare PyTorch loop.

    python bench/overhead.py --rounds 2 --supernodes 10 --repeats 3
    python bench/overhead.py --matrix --rounds 5 --repeats 2   # one evidence-matrix cell
    python bench/overhead.py --matrix --rounds 5 --repeats 2 --device cuda   # on a GPU

FedAvg on digits (``--matrix``: on a matrix cell's configuration, Dirichlet 0.1 over 20
clients of the report pool, LeNet-5, 5 local epochs; bare and warm only; ``--device cuda``:
the bare loop on the GPU and each simulated client on its share of it). Four ways to run
the same rounds, each ``--repeats`` times, medians:

- bare: the same clients (data partitions), seeded model, local rule and personalized
  evaluation in one process, state dicts averaged in-process, no Flower at all;
- cold: ``bash scripts/demo.sh`` as a user types it (SUPERNODES set): environment check,
  a private SuperLink started and stopped, a private Ray instance inside the run;
- warm: runs one after another as the test session and the benchmarks run them
  (``launch.federation.warm_federation``: one SuperLink, Ray head and fork server kept up,
  the next run's Ray workers started early); the first warm run is left out;
- side by side: two such warm federations (one fork server) running at once, as the test
  session's workers do, each ``--repeats`` runs after a first one left out; a run's wall time
  is the elapsed time of all of them over their number, so that one lane's waits may be
  spent on the other's work.

A run's fixed cost is its wall time minus the sum of its rounds' seconds (``results.json``).
Writes ``bench/results/overhead.md`` (``--matrix``: ``overhead-matrix.md``, on a GPU
``overhead-matrix-cuda.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median

import torch
from flwr.app import Context, RecordDict

from bench.report import machine, write_report
from client_app.runtime import Client
from launch.app_project import app_defaults
from launch.federation import LocalFederation, warm_federation
from launch.ray_head import gpus_per_client
from launch.warm_start import ForkServer
from strategies.registry import build_model
from strategies.training import LocalTraining, evaluate_model

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(run_config: dict, num_clients: int, rounds: int) -> list[float]:
    """FedAvg in one process; returns seconds per round."""
    clients = [Client.from_context(Context(
        run_id=0, node_id=i, node_config={"partition-id": i, "num-partitions": num_clients},
        state=RecordDict(), run_config={**app_defaults(), **run_config}))
        for i in range(num_clients)]
    settings = clients[0].settings
    global_state = {k: v for k, v in build_model(settings).state_dict().items()
                    if not k.endswith("num_batches_tracked")}
    seconds = []
    for server_round in range(1, rounds + 1):
        start = time.perf_counter()
        states, weights = [], []
        for client in clients:
            model = build_model(settings).to(client.device)
            model.load_state_dict(global_state, strict=False)
            client.method.local_train(LocalTraining(
                model, client.loader(True, server_round), settings, client.device, server_round))
            states.append(model.state_dict())
            weights.append(len(client.data().y_train))
        total = sum(weights)
        global_state = {k: sum(s[k].float() * (w / total) for s, w in zip(states, weights,
                                                                          strict=True))
                        for k in global_state}
        for client in clients:
            model = build_model(settings).to(client.device)
            model.load_state_dict(global_state, strict=False)
            evaluate_model(model, client.loader(False), client.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def rounds_seconds(out: Path) -> float:
    return sum(r["seconds"] for r in json.loads((out / "results.json").read_text())["rounds"])


def cold_run(config: dict, supernodes: int, out: Path) -> tuple[float, float]:
    """``bash scripts/demo.sh`` with ``config``: (wall seconds, seconds of its rounds)."""
    overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in {**config, "output-dir": out}.items()]
    start = time.perf_counter()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), *overrides],
                          capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "SUPERNODES": str(supernodes)})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return wall, rounds_seconds(out)


def timed_run(federation: LocalFederation, config: dict, supernodes: int, out: Path,
              timeout: float = 900) -> tuple[float, float]:
    """One run of ``config`` on ``federation`` into ``out``: (wall seconds, seconds of its
    rounds); a failed run stops the benchmark with its output."""
    start = time.perf_counter()
    run = federation.run(ROOT, {**config, "output-dir": str(out)}, num_supernodes=supernodes,
                         gpus_per_client=gpus_per_client(config["device"]), timeout=timeout)
    wall = time.perf_counter() - start
    if not run.ok:
        raise SystemExit(f"{out.name}: the run failed ({run.status}):\n{run.output[-3000:]}")
    return wall, rounds_seconds(out)


def warm_runs(config: dict, supernodes: int, count: int, tmp: Path
              ) -> list[tuple[float, float]]:
    """``count`` runs on one SuperLink and one Ray head, after a first one left out."""
    with warm_federation() as federation:
        timed = [timed_run(federation, config, supernodes, tmp / f"warm-{index}")
                 for index in range(count + 1)]
    return timed[1:]


def side_by_side_runs(config: dict, supernodes: int, count: int, tmp: Path, lanes: int = 2
                      ) -> tuple[float, list[tuple[float, float]]]:
    """``lanes`` warm federations, one fork server, each running ``count`` runs at once after
    a first one left out: (seconds from the first timed run's start to the last one's end,
    every timed run's wall and rounds)."""
    ready = threading.Barrier(lanes)
    starts: list[float] = []
    ends: list[float] = []

    def lane(index: int, federation: LocalFederation) -> list[tuple[float, float]]:
        try:
            timed_run(federation, config, supernodes, tmp / f"lane{index}-first")
        except BaseException:
            ready.abort()  # the other lane stops waiting for this one
            raise
        ready.wait()
        starts.append(time.perf_counter())
        timed = [timed_run(federation, config, supernodes, tmp / f"lane{index}-{run}")
                 for run in range(count)]
        ends.append(time.perf_counter())
        return timed

    with ForkServer() as forks, contextlib.ExitStack() as stack:
        federations = [stack.enter_context(warm_federation(forkserver=forks))
                       for _ in range(lanes)]
        with ThreadPoolExecutor(lanes) as pool:  # a lane's failure is raised here
            done = [future.result() for future in
                    [pool.submit(lane, index, fed) for index, fed in enumerate(federations)]]
    return max(ends) - min(starts), [run for timed in done for run in timed]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--supernodes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--matrix", action="store_true",
                        help="a matrix cell's configuration (20 clients), bare and warm only")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the bare loop and every client train (cuda: --matrix only)")
    args = parser.parse_args()
    if args.device != "cpu" and not args.matrix:
        parser.error("--device cuda times a matrix cell (--matrix): the demo has no GPU share")
    config = {"method": "fedavg", "num-server-rounds": args.rounds, "plot": False,
              "device": args.device}
    if args.matrix:
        from bench.evidence.protocol import COMMON, NUM_CLIENTS, SCENARIOS, pool_file
        config = {**COMMON, **SCENARIOS["dirichlet-0.1"].config, **config, "lr": 0.03,
                  "dataset": str(pool_file())}
        args.supernodes = NUM_CLIENTS

    torch.set_num_threads(1)  # as each Ray ClientApp worker (client-resources-num-cpus=1)
    bare = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        seconds = bare_loop(config, args.supernodes, args.rounds)
        bare.append((time.perf_counter() - start, sum(seconds)))
    with tempfile.TemporaryDirectory() as tmp:
        warm = warm_runs(config, args.supernodes, args.repeats, Path(tmp))
        if args.matrix:
            matrix_report(args, bare, warm)
            return
        cold = [cold_run(config, args.supernodes, Path(tmp) / f"cold-{i}")
                for i in range(args.repeats)]
        elapsed, paired = side_by_side_runs(config, args.supernodes, args.repeats, Path(tmp))

    bare_rounds = median(r for _, r in bare)
    rows = []
    for name, runs in (("bare PyTorch loop", bare), ("cold: `bash scripts/demo.sh`", cold),
                       ("warm: `warm_federation` (kept SuperLink, Ray head, fork server; "
                        "primed workers)", warm)):
        wall, rounds = median(w for w, _ in runs), median(r for _, r in runs)
        fixed = median(w - r for w, r in runs)
        rows.append(f"| {name} | {wall:.1f} s | {rounds:.1f} s | {fixed:.1f} s | "
                    f"{rounds / bare_rounds:.1f}x |")
    per_run, paired_rounds = elapsed / len(paired), median(r for _, r in paired)
    rows.append(f"| warm, two side by side (elapsed / runs; each run's own wall "
                f"{median(w for w, _ in paired):.1f} s) | {per_run:.1f} s | "
                f"{paired_rounds:.1f} s | {per_run - paired_rounds:.1f} s | "
                f"{paired_rounds / bare_rounds:.1f}x |")
    table = ("| how | wall time | its rounds (sum) | fixed cost (wall - rounds) | rounds / bare "
             "rounds |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
             f"Medians of {args.repeats} repeats each; every run's wall and rounds: bare "
             f"{_pairs(bare)}; cold {_pairs(cold)}; warm {_pairs(warm)}; side by side "
             f"{_pairs(paired)}, {len(paired)} runs in {elapsed:.1f} s.\n")
    command = (f"python bench/overhead.py --rounds {args.rounds} --supernodes "
               f"{args.supernodes} --repeats {args.repeats}")
    write_report("overhead", f"A run's fixed cost (FedAvg, digits, {args.supernodes} clients, "
                 f"{args.rounds} rounds)", command, table)


def matrix_report(args: argparse.Namespace, bare: list[tuple[float, float]],
                  warm: list[tuple[float, float]]) -> None:
    bare_rounds = median(r for _, r in bare)
    rows = [f"| {name} | {median(w for w, _ in runs):.1f} s | {median(r for _, r in runs):.1f} s "
            f"| {median(r for _, r in runs) / bare_rounds:.2f}x |"
            for name, runs in (("bare PyTorch loop", bare), ("warm matrix run", warm))]
    table = ("| how | wall time | its rounds (sum) | rounds / bare rounds |\n|---|---|---|---|\n"
             + "\n".join(rows) + f"\n\nMedians of {args.repeats} repeats; every run's wall "
             f"and rounds: bare {_pairs(bare)}; warm {_pairs(warm)}.\n")
    on_gpu = args.device == "cuda"
    write_report("overhead-matrix" + ("-cuda" if on_gpu else ""),
                 f"A matrix cell's cost against a bare PyTorch loop (FedAvg, Dirichlet 0.1, "
                 f"{args.supernodes} clients, {args.rounds} rounds"
                 + (", on a GPU)" if on_gpu else ")"),
                 f"python bench/overhead.py --matrix --rounds {args.rounds} --repeats "
                 f"{args.repeats}" + (" --device cuda" if on_gpu else ""),
                 f"On {machine()}.\n\n" + table)


def _pairs(runs: list[tuple[float, float]]) -> str:
    return ", ".join(f"{w:.1f}/{r:.1f} s" for w, r in runs)


if __name__ == "__main__":
    main()
