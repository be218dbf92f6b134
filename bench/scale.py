"""Many simulated clients on one machine: round time, peak memory, server state per client.

    python bench/scale.py                      # all three parts below
    python bench/scale.py --parts ratio        # or: thousand, methods

- ``ratio``: FedAvg on the same 20,000-image pool (Fashion-MNIST, seeded subsample) split
  over 10 and over 100 clients (Dirichlet 0.5, 3 rounds): seconds per round and their ratio,
  ``--repeats`` interleaved pairs (the median of the pairs' ratios is reported).
- ``thousand``: FedAvg with 1,000 clients, ``fraction-train = 0.1``, 5 rounds.
- ``methods``: each of the four paper methods, 1,000 clients, ``fraction-train = 0.1``,
  3 rounds.

Per run: median seconds per round (rounds 2..), the peak resident memory of the process that
runs the ServerApp (``flwr-simulation``) and of the largest Ray worker, sampled every 0.5 s,
and the server's per-client state: the bytes of its checkpointed per-client tables
(every dict keyed by client id in its checkpoint, stored as the checkpoint stores them)
divided by the number of clients they cover. Writes ``bench/results/scale-<parts>.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import RESULTS, write_report
from common.durable import load_tree, save_tree
from launch.federation import LocalFederation
from server_app.results import CHECKPOINT

ROOT = Path(__file__).resolve().parents[1]

MB = 1024**2
POOL_SIZE = 20_000


class PeakMemory(threading.Thread):
    """Samples the resident memory of this machine's ``flwr-simulation`` process and Ray
    ClientApp workers every ``interval`` seconds; keeps each kind's maximum."""

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.peak = {"serverapp": 0, "worker": 0}
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                kind = ("serverapp" if b"flwr-simulation" in cmd else
                        "worker" if b"ClientAppActor" in cmd else None)
                if kind is None:
                    continue
                rss = next((int(line.split()[1]) * 1024 for line in status.splitlines()
                            if line.startswith("VmRSS:")), 0)
                self.peak[kind] = max(self.peak[kind], rss)
            self._done.wait(self.interval)

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


def fashion_pool(path: Path) -> Path:
    """A seeded 20,000-image subsample of Fashion-MNIST as a local ``.npz`` pool."""
    from bench.data import ensure_dataset
    from fldata.sources import load_local

    x, y = load_local(ensure_dataset("fashion-mnist"))
    keep = np.random.default_rng(0).permutation(len(y))[:POOL_SIZE]
    np.savez(path, x=x[keep], y=y[keep])
    return path


def per_client_state(out: Path) -> tuple[int, int]:
    """(bytes of the server's per-client tables as the checkpoint stores them, number of
    clients in them)."""
    checkpoint = load_tree(out / CHECKPOINT)
    clients = set(checkpoint["nodes"]["last_seen"])  # every client id the server has heard from
    state = {"last_seen": checkpoint["nodes"]["last_seen"],
             "per_client_accuracy": checkpoint["evaluation"]["per_client_accuracy"],
             "example_counts": checkpoint["example_counts"], **checkpoint["rule"]}
    # the tables keyed by client id (not, e.g., FedFac's split, keyed by layer)
    tables = {k: v for k, v in state.items()
              if isinstance(v, dict) and v and set(v) <= clients}
    stored = out / "per-client-tables.npz"
    save_tree(stored, tables)
    return stored.stat().st_size, len(clients)


def run(federation: LocalFederation, config: dict[str, Any], clients: int,
        out: Path) -> dict[str, Any]:
    memory = PeakMemory()
    memory.start()
    start = time.perf_counter()
    done = federation.run(ROOT, {**config, "output-dir": str(out), "plot": False},
                          num_supernodes=clients, timeout=7200)
    wall = time.perf_counter() - start
    peak = memory.stop()
    if not done.ok:
        raise SystemExit(done.output[-3000:])
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    table_bytes, known = per_client_state(out)
    return {"clients": clients, "wall": wall,
            "round_seconds": statistics.median(r["seconds"] for r in rounds[1:] or rounds),
            "serverapp_mb": peak["serverapp"] / MB, "worker_mb": peak["worker"] / MB,
            "state_bytes_per_client": table_bytes / max(known, 1), "known_clients": known,
            "accuracy": rounds[-1]["eval"]["accuracy_weighted"],
            "evaluated": rounds[-1]["eval"]["num_clients"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="ratio,thousand,methods")
    parser.add_argument("--repeats", type=int, default=3, help="ratio: interleaved pairs")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, LocalFederation() as federation:
        pool = fashion_pool(Path(tmp) / "pool.npz")
        base = {"dataset": str(pool), "partitioner": "dirichlet", "dirichlet-alpha": 0.5,
                "local-epochs": 1}
        if "ratio" in parts:
            for repeat in range(1, args.repeats + 1):
                for clients in (10, 100):
                    rows[f"fedavg, {clients} clients (pair {repeat})"] = run(
                        federation, {**base, "method": "fedavg", "num-server-rounds": 3},
                        clients, Path(tmp) / f"ratio-{clients}-{repeat}")
        # 1,000 clients of 20 images on average: Dirichlet 0.5 cannot give each 10
        thousand = {**base, "min-partition-size": 2, "fraction-train": 0.1,
                    "fraction-evaluate": 0.1}
        if "thousand" in parts:
            rows["fedavg, 1000 clients, fraction-train 0.1"] = run(
                federation, {**thousand, "method": "fedavg", "num-server-rounds": 5}, 1000,
                Path(tmp) / "thousand")
        if "methods" in parts:
            for method in ("feddecomp", "pfedc", "factorized-fl", "fedfac"):
                rows[f"{method}, 1000 clients, fraction-train 0.1"] = run(
                    federation, {**thousand, "method": method, "num-server-rounds": 3}, 1000,
                    Path(tmp) / f"methods-{method}")
    lines = ["| run | median s/round | whole run | peak RSS ServerApp | peak RSS worker | "
             "server state per client | final acc (clients evaluated) |",
             "|---|---|---|---|---|---|---|"]
    for label, r in rows.items():
        lines.append(f"| {label} | {r['round_seconds']:.1f} s | {r['wall']:.0f} s | "
                     f"{r['serverapp_mb']:.0f} MB | {r['worker_mb']:.0f} MB | "
                     f"{r['state_bytes_per_client'] / 1024:.1f} KiB ({r['known_clients']}) | "
                     f"{r['accuracy']:.4f} ({r['evaluated']}) |")
    pairs = range(1, args.repeats + 1) if "ratio" in parts else range(0)
    ratios = [rows[f"fedavg, 100 clients (pair {k})"]["round_seconds"]
              / rows[f"fedavg, 10 clients (pair {k})"]["round_seconds"] for k in pairs]
    if ratios:
        lines += ["", f"100 vs 10 clients, same data: **{statistics.median(ratios):.2f}x** "
                  f"seconds per round (median of {len(ratios)} interleaved pairs: "
                  + ", ".join(f"{r:.2f}x" for r in ratios) + ")."]
    command = f"python bench/scale.py --parts {args.parts}" + (
        f" --repeats {args.repeats}" if "ratio" in parts else "")
    name = "scale-" + "-".join(args.parts.split(","))  # one report per set of parts
    write_report(name, "Many clients on one machine (Fashion-MNIST, 20,000 images)",
                 command, "\n".join(lines) + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps({"command": command, "runs": rows},
                                                     indent=2))


if __name__ == "__main__":
    main()
