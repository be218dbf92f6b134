"""A run's fixed cost, cold and warm, against Flower's own floor app and a bare PyTorch loop.

    python bench/overhead.py --rounds 2 --supernodes 10 --repeats 3
    python bench/overhead.py --cold-only --repeats 5   # the demo against Flower's floor only
    python bench/overhead.py --matrix --rounds 5 --repeats 2   # one evidence-matrix cell
    python bench/overhead.py --matrix --rounds 5 --repeats 2 --device cuda   # on a GPU

FedAvg on digits (``--matrix``: on a matrix cell's configuration, Dirichlet 0.1 over 20
clients of the report pool, LeNet-5, 5 local epochs; bare and warm only; ``--device cuda``:
the bare loop on the GPU and each simulated client on its share of it). Four ways to run
the same rounds, and Flower's floor, each ``--repeats`` times, medians:

- bare: the same clients (data partitions), seeded model, local rule and personalized
  evaluation in one process, state dicts averaged in-process, no Flower at all;
- cold: ``bash scripts/demo.sh`` as a user types it (SUPERNODES set): environment check,
  a private SuperLink started and stopped, a private Ray instance inside the run; beside
  Flower's floor (``bench/floor_app``, a preflight and replies at once from a ClientApp that
  imports PyTorch, started by ``flwr run`` as Flower starts it), interleaved, with the
  timeline of both (``MILESTONES``: from their output, their processes, the launcher's marks);
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
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import NamedTuple

import torch
from flwr.app import Context, RecordDict

from bench.report import machine, produced_by, write_report
from client_app.runtime import Client
from launch.app_project import app_defaults, app_packages
from launch.federation import SUPEREXEC_POLL_SECONDS, LocalFederation, warm_federation
from launch.processes import free_port, watch
from launch.ray_head import gpus_per_client
from launch.run_output import TIMELINE_ENV
from launch.warm_start import ForkServer
from strategies.registry import build_model
from strategies.training import LocalTraining, evaluate_model

ROOT = Path(__file__).resolve().parents[1]
FLOOR_APP = ROOT / "bench" / "floor_app"


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


# A cold run's milestones: (name, how it shows, what shows it). "process": a process of the run
# whose command line holds the text starts (a Ray worker: takes it as its title); "line": the
# first output line that holds it; "mark": the launcher's own (launch.run_output.mark)
MILESTONES = (
    ("SuperLink process started", "process", ("flower-superlink",)),
    ("config checked (launcher)", "mark", ("config checked",)),
    ("SuperExec started (SuperLink serving)", "process", ("flower-superexec",)),
    ("run's process started (flwr-simulation)", "process", ("flwr-simulation",)),
    ("simulation started (Flower's first line)", "line", ("Starting Flower Simulation",)),
    ("Ray starts (gcs_server)", "process", ("gcs_server",)),
    ("ServerApp ready (its first line)", "line", ("[start] ",)),
    ("first Ray worker", "process", ("default_worker.py",)),
    ("first ClientAppActor", "process", ("ray::ClientAppActor",)),
    ("preflight answered (data, model)", "line", ("identify: ", "preflight: ")),
    ("rounds done, results written", "line", ("[final] wrote to",)),
)


class ColdRun(NamedTuple):
    wall: float  # from the command's start to its exit
    rounds: float  # the seconds of its rounds (the app's own record)
    events: dict[str, float]  # milestone: seconds from the start
    cpu: float  # CPU seconds of the command and every process it started
    others: float  # cores busy with other work meanwhile (``launch.processes.Watched``)

    @property
    def fixed(self) -> float:  # its fixed cost
        return self.wall - self.rounds


def watched_run(command: list[str], env: dict[str, str], rounds_of: Callable[[], float],
                may_leave: bool = False) -> ColdRun:
    """``command`` run to its exit (``launch.processes.watch``: what still runs after it is
    stopped then, untimed: the SuperLink a plain ``flwr run`` leaves up, where ``may_leave``,
    else the benchmark stops), its ``MILESTONES`` read from its output, its processes and the
    launcher's marks. ``rounds_of()``: its rounds' seconds, read after it exits."""
    marks = Path(tempfile.mkstemp(prefix="timeline-")[1])
    try:
        run = watch(command, {**env, TIMELINE_ENV: str(marks)}, ROOT)
        seen = {"line": run.lines, "process": run.titles, "mark": [
            (float(at) - run.started, what) for at, _, what in
            (line.partition(" ") for line in marks.read_text().splitlines())]}
    finally:
        marks.unlink()
    if run.code != 0 or (run.left and not may_leave):
        output = "".join(line for _, line in run.lines)
        raise SystemExit(f"{' '.join(command[:3])} failed ({run.code}; left running: "
                         f"{run.left}):\n{output[-3000:]}")
    events = {name: hits[0] for name, how, shows in MILESTONES
              if (hits := [at for at, text in seen[how] if any(s in text for s in shows)])}
    return ColdRun(run.wall, rounds_of(), events, run.cpu, run.others)


def demo_cold(config: dict, supernodes: int, out: Path) -> ColdRun:
    """``bash scripts/demo.sh`` as a user types it (SUPERNODES set), with ``config``."""
    overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in {**config, "output-dir": out}.items()]
    return watched_run(["bash", str(ROOT / "scripts" / "demo.sh"), *overrides],
                       {**os.environ, "SUPERNODES": str(supernodes)},
                       lambda: rounds_seconds(out))


def floor_cold(supernodes: int, rounds: int, out: Path) -> ColdRun:
    """Flower's own cold start of its floor app: ``flwr run --stream``, which starts a local
    SuperLink itself, in a fresh ``FLWR_HOME`` on free ports, set as ``cold_report`` says."""
    home = Path(tempfile.mkdtemp(prefix="flwr-floor-"))
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "FLWR_HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()), "FLWR_TELEMETRY_ENABLED": "0",
           "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": str(SUPEREXEC_POLL_SECONDS)}
    try:
        return watched_run(
            [f"{bin_dir}/flwr", "run", str(FLOOR_APP), "--stream", "--federation-config",
             f"num-supernodes={supernodes} client-resources-num-cpus=1", "--run-config",
             f"num-server-rounds={rounds} min-nodes={supernodes} output-dir='{out}'"], env,
            lambda: sum(json.loads((out / "floor.json").read_text())["round_seconds"]),
            may_leave=True)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def cold_pairs(config: dict, supernodes: int, repeats: int, tmp: Path
               ) -> tuple[list[ColdRun], list[ColdRun]]:
    """The demo and the floor cold, ``repeats`` times each, interleaved (the order turned each
    time), after a pair left out (``cold_report`` says why)."""
    demo, floor = [], []
    for index in range(repeats + 1):
        pair = [("demo", demo_cold, (config, supernodes, tmp / f"demo-{index}")),
                ("floor", floor_cold, (supernodes, config["num-server-rounds"],
                                       tmp / f"floor-{index}"))]
        for name, run, arguments in pair if index % 2 else reversed(pair):
            timed = run(*arguments)
            print(f"{name} {index}: wall {timed.wall:.1f} s, rounds {timed.rounds:.1f} s, "
                  f"other work {timed.others:.2f} cores", flush=True)
            if index:
                (demo if name == "demo" else floor).append(timed)
    return demo, floor


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
    parser.add_argument("--cold-only", action="store_true", help="the demo and the floor only")
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
    if args.cold_only:  # printed, no report
        with tempfile.TemporaryDirectory() as tmp:
            print(cold_report(*cold_pairs(config, args.supernodes, args.repeats, Path(tmp))))
        return

    torch.set_num_threads(1)  # as each Ray ClientApp worker (client-resources-num-cpus=1)
    bare = []
    for _ in range(args.repeats):
        start, seconds = time.perf_counter(), sum(bare_loop(config, args.supernodes, args.rounds))
        bare.append((time.perf_counter() - start, seconds))
    with tempfile.TemporaryDirectory() as tmp:
        warm = warm_runs(config, args.supernodes, args.repeats, Path(tmp))
        if args.matrix:
            matrix_report(args, bare, warm)
            return
        demo, floor = cold_pairs(config, args.supernodes, args.repeats, Path(tmp))
        elapsed, paired = side_by_side_runs(config, args.supernodes, args.repeats, Path(tmp))

    cold, floors = ([(run.wall, run.rounds) for run in runs] for runs in (demo, floor))
    bare_rounds = median(r for _, r in bare)
    rows = []
    for name, runs in (("bare PyTorch loop", bare), ("cold: `bash scripts/demo.sh`", cold),
                       ("cold: Flower's floor app, `flwr run` (below)", floors),
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
             f"{_pairs(bare)}; cold {_pairs(cold)}; floor {_pairs(floors)}; warm "
             f"{_pairs(warm)}; side by side {_pairs(paired)}, {len(paired)} runs in "
             f"{elapsed:.1f} s.\n")
    command = (f"python bench/overhead.py --rounds {args.rounds} --supernodes "
               f"{args.supernodes} --repeats {args.repeats}")
    code = produced_by("pyproject.toml", *app_packages(), "launch", "scripts",
                       "bench/overhead.py", "bench/floor_app")
    write_report("overhead", f"A run's fixed cost (FedAvg, digits, {args.supernodes} clients, "
                 f"{args.rounds} rounds)", command,
                 f"On {machine()}; the app, launcher and benchmark at `{code}`.\n\n" + table
                 + "\n" + cold_report(demo, floor))


def cold_report(demo: list[ColdRun], floor: list[ColdRun]) -> str:
    """The demo's cold start against Flower's floor: the ratio of their fixed costs, each
    milestone's median time, every pair, and how busy the machine was with other work."""
    ratios = [d.fixed / f.fixed for d, f in zip(demo, floor, strict=True)]
    others, quiet = [run.others for run in demo + floor], 0.1  # cores busy with other work
    calm = [r for d, f, r in zip(demo, floor, ratios, strict=True)
            if max(d.others, f.others) < quiet]
    rows = [f"| {name} | {_at(demo, name)} | {_at(floor, name)} |" for name, *_ in MILESTONES]
    rows += [f"| {name} | {median(getattr(r, key) for r in demo):.1f} s | "
             f"{median(getattr(r, key) for r in floor):.1f} s |" for name, key in (
                 ("the command exits (wall time)", "wall"),
                 ("fixed cost (wall - rounds)", "fixed"), ("CPU, all its processes", "cpu"))]
    pairs = "; ".join(f"{d.wall:.1f}/{d.rounds:.1f} s against {f.wall:.1f}/{f.rounds:.1f} s "
                      f"({ratio:.2f}x; other work {d.others:.2f}/{f.others:.2f} cores)"
                      for d, f, ratio in zip(demo, floor, ratios, strict=True))
    return (
        "## A cold start against Flower's own\n\n"
        f"The demo's fixed cost is **{median(ratios):.2f}x** Flower's floor app's (median of "
        f"{len(ratios)} interleaved pairs' ratios; ratio of the medians "
        f"{median(r.fixed for r in demo) / median(r.fixed for r in floor):.2f}x). The floor "
        "(`bench/floor_app`): a preflight query to every node, then one message a round, each "
        "answered at once by a ClientApp that imports PyTorch, run as Flower runs it: `flwr "
        "run bench/floor_app --stream` starts its own SuperLink; the demo's federation (as "
        "many SuperNodes, one CPU a client), its SuperExec poll, no dependency install. Its "
        "wall time ends as `flwr run` exits (the SuperLink it leaves up is stopped after, "
        "untimed), the demo's as `scripts/demo.sh` exits, all it started stopped. The two "
        "alternate, the order turned each pair, after a pair left out (files in the page "
        "cache; the clients' splits in their cache, as on a user's second run).\n\n"
        + (f"The machine was {'quiet' if max(others) < quiet else '**not quiet**'}: other "
           f"work kept {median(others):.2f} of its {os.cpu_count()} cores busy during a run "
           f"(median; {min(others):.2f} to {max(others):.2f}; the benchmark's own watching "
           f"not counted). Over the pairs with under {quiet} cores of it in either run "
           f"({len(calm)} of {len(ratios)}): {f'{median(calm):.2f}x' if calm else '-'}.\n\n")
        + "Timeline, seconds from the command's start (medians; \"ServerApp ready\" is its "
        "first line, \"preflight answered\" every client's first message: the demo's loads "
        "its data and builds its model):\n\n"
        "| milestone | demo | floor |\n|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Every pair (wall/rounds, demo against floor): {pairs}.\n")


def _at(runs: list[ColdRun], name: str) -> str:
    seen = [run.events[name] for run in runs if name in run.events]
    return f"{median(seen):.1f} s" if len(seen) == len(runs) else "–"


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
