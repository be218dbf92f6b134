"""The app's overhead: FedAvg through ``flwr run`` against a bare in-process PyTorch loop.

    python bench/overhead.py --rounds 5 --supernodes 10

Both sides use the same clients (data partitions), the same seeded model, the same local
training rule and the same personalized evaluation; the bare loop averages the state dicts
in-process with no Flower at all. Reports wall time of the whole ``flwr run`` (SuperLink
already up; Ray start-up, app install and all rounds included), the steady-state seconds
per round (rounds 2..), and their ratios to the bare loop. Writes ``bench/results/overhead.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flwr.app import Context, RecordDict  # noqa: E402

from bench.report import write_report  # noqa: E402
from client_app.runtime import Client  # noqa: E402
from common.config import app_defaults  # noqa: E402
from launch.federation import LocalFederation  # noqa: E402
from strategies.registry import build_model  # noqa: E402
from strategies.training import LocalTraining, evaluate  # noqa: E402


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
            model = build_model(settings)
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
            model = build_model(settings)
            model.load_state_dict(global_state, strict=False)
            evaluate(model, client.loader(False), client.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--supernodes", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as each Ray ClientApp worker (client-resources-num-cpus=1)
    run_config = {"method": "fedavg", "num-server-rounds": args.rounds, "plot": False}

    bare_start = time.perf_counter()
    bare = bare_loop(run_config, args.supernodes, args.rounds)
    bare_total = time.perf_counter() - bare_start

    with tempfile.TemporaryDirectory() as out, LocalFederation() as federation:
        start = time.perf_counter()
        run = federation.run(ROOT, {**run_config, "output-dir": out},
                             num_supernodes=args.supernodes)
        flower_total = time.perf_counter() - start
        if not run.ok:
            raise SystemExit(run.output[-3000:])
        flower = [r["seconds"] for r in json.loads((Path(out) / "results.json").read_text())[
            "rounds"]]

    steady_bare = sum(bare[1:]) / max(len(bare) - 1, 1)
    steady_flower = sum(flower[1:]) / max(len(flower) - 1, 1)
    table = (
        "| | bare PyTorch loop | flwr run (simulation) | ratio |\n|---|---|---|---|\n"
        f"| wall time, {args.rounds} rounds | {bare_total:.1f} s | {flower_total:.1f} s | "
        f"{flower_total / bare_total:.1f}x |\n"
        f"| rounds only (sum) | {sum(bare):.1f} s | {sum(flower):.1f} s | "
        f"{sum(flower) / sum(bare):.1f}x |\n"
        f"| steady round (mean of rounds 2..) | {steady_bare:.2f} s | {steady_flower:.2f} s | "
        f"{steady_flower / steady_bare:.1f}x |\n")
    command = f"python bench/overhead.py --rounds {args.rounds} --supernodes {args.supernodes}"
    write_report("overhead", f"Overhead of the Flower app (FedAvg, digits, {args.supernodes} "
                 "clients)", command, table)


if __name__ == "__main__":
    main()
