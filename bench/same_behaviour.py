"""Does a change keep behaviour? Short real runs of every method, made once with the app of
another checkout (``--before``: the commit before the change) and once with this one, on one
warm federation, compared exactly: per round every client's personalized accuracy, the train
loss, bytes up and down, the dropped replies and the method's own reports; the server's
tables; FedFac's new-client results. Times are not compared.

    git worktree add /tmp/before HEAD         # before committing the change
    python bench/same_behaviour.py --before /tmp/before

The cases cover every method (fused evaluation, the default), the two-exchange protocol,
cross-device sampling (a fraction of the clients each round) and FedFac's after-training
queries. The table goes to ``bench/results/same_behaviour.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import write_report
from launch.federation import warm_federation

ROOT = Path(__file__).resolve().parents[1]

SHORT = {"num-server-rounds": 3, "local-epochs": 2, "plot": False}
METHODS = ["fedavg", "fedprox", "local", "fedper", "fedrep", "fedbn", "fedavg-ft", "feddecomp",
           "pfedc", "factorized-fl", "fedfac"]
# (label, run config, simulated clients)
CASES: list[tuple[str, dict[str, Any], int]] = [
    *[(method, {"method": method}, 4) for method in METHODS],
    ("fedfac dynamic, new clients", {"method": "fedfac", "fedfac.mode": "dynamic",
                                     "fedfac.new-clients": 0.25}, 4),
    ("fedavg, two exchanges", {"method": "fedavg", "fused-evaluation": False}, 4),
    *[(f"{method}, cross-device", {"method": method, "fraction-train": 0.3,
                                   "fraction-evaluate": 0.3, "num-server-rounds": 5}, 10)
      for method in ("fedper", "factorized-fl", "pfedc")],
]
TIMES = {"seconds", "seconds_total", "cpu_seconds", "client_seconds", "exchange_seconds",
         "analysis_seconds"}


def without_times(value: Any) -> Any:
    """``value`` with every timing field left out (they differ between any two runs)."""
    if isinstance(value, dict):
        return {k: without_times(v) for k, v in value.items() if k not in TIMES}
    if isinstance(value, list):
        return [without_times(v) for v in value]
    return value


def compared(results: dict[str, Any]) -> dict[str, Any]:
    """What is compared: everything but the config and times, with node ids (Flower draws
    new ones for every run) replaced by the client ids they stand for."""
    kept = without_times({k: v for k, v in results.items() if k != "config"})
    state = kept.get("server_state", {})
    if "node_to_client" in state:
        state["node_to_client"] = sorted(state["node_to_client"].values(), key=str)
    for entry in kept.get("rounds", []):
        for dropped in entry.get("dropped", []):
            dropped.pop("node", None)
    return kept


def first_difference(before: Any, after: Any, path: str = "",
                     new_fields: frozenset[str] = frozenset(),
                     added: list[str] | None = None) -> str | None:
    """Where ``after`` first differs from ``before`` (None: nowhere); a key only in
    ``after`` whose name is in ``new_fields`` is a field the change adds, not a difference
    (its path goes to ``added``: it also shows that the after side ran the new code)."""
    if type(before) is not type(after):
        return f"{path}: {before!r} vs {after!r}"[:200]
    if isinstance(before, dict):
        for key in sorted(set(before) | set(after), key=str):
            if key not in before and key in new_fields:
                if added is not None:
                    added.append(f"{path}.{key}".lstrip("."))
                continue
            if key not in before or key not in after:
                return f"{path}.{key}: only in {'after' if key in after else 'before'}"
            found = first_difference(before[key], after[key], f"{path}.{key}", new_fields,
                                     added)
            if found:
                return found
        return None
    if isinstance(before, list):
        if len(before) != len(after):
            return f"{path}: {len(before)} vs {len(after)} entries"
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            found = first_difference(b, a, f"{path}[{i}]", new_fields, added)
            if found:
                return found
        return None
    return None if before == after else f"{path}: {before!r} vs {after!r}"[:200]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a checkout of the code before")
    parser.add_argument("--only", action="append", default=[],
                        help="a case's label (repeat for several; labels hold commas)")
    parser.add_argument("--new-fields", default="", help="comma-separated names of fields "
                        "the change adds to results.json (listed, not a difference)")
    args = parser.parse_args()
    before_app = Path(args.before).resolve()
    before_commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                                   cwd=before_app, capture_output=True, text=True
                                   ).stdout.strip() or "not a git checkout"
    new_fields = frozenset(filter(None, args.new_fields.split(",")))
    unknown = set(args.only) - {label for label, _, _ in CASES}
    if unknown:
        parser.error(f"--only: no case {', '.join(sorted(unknown))}")
    cases = [c for c in CASES if not args.only or c[0] in args.only]
    lines = ["| case | clients | rounds | final accuracy | identical | fields added |",
             "|---|---|---|---|---|---|"]
    differing = []
    with tempfile.TemporaryDirectory() as tmp, warm_federation() as federation:
        for label, overrides, clients in cases:
            results = {}
            for side, app in (("before", before_app), ("after", ROOT)):
                out = Path(tmp) / label.replace(" ", "_").replace(",", "") / side
                config = {**SHORT, **overrides, "output-dir": str(out)}
                run = federation.run(app, config, num_supernodes=clients)
                if not run.ok:
                    raise SystemExit(f"{label} ({side}): {run.status} {run.reason}")
                results[side] = json.loads((out / "results.json").read_text())
            added: list[str] = []
            difference = first_difference(compared(results["before"]), compared(results["after"]),
                                          new_fields=new_fields, added=added)
            if difference:
                differing.append(f"{label}: {difference}")
            final = results["after"]["final"]["accuracy_weighted"]
            lines.append(f"| {label} | {clients} | {len(results['after']['rounds'])} | "
                         f"{final:.4f} | {'yes' if difference is None else 'NO'} | "
                         f"{', '.join(added) or '-'} |")
            print(lines[-1] + (f" {difference}" if difference else ""), flush=True)
    added = f" Fields the change adds: {', '.join(sorted(new_fields))}." if new_fields else ""
    body = (f"Before: the app of `{before_app}` (commit `{before_commit}`); after: this "
            "checkout. Identical: results.json "
            "equal but for times (per round every client's accuracy, loss, bytes, drops and "
            f"the method's reports; the server's tables; FedFac's new clients).{added}\n\n"
            + "\n".join(lines) + "\n"
            + ("".join(f"\n- {d}" for d in differing) + "\n" if differing else ""))
    command = shlex.join(["python", "bench/same_behaviour.py", *sys.argv[1:]])
    write_report("same_behaviour", "Same behaviour before and after a change", command, body)
    sys.exit(1 if differing else 0)


if __name__ == "__main__":
    main()
