"""Reuse a stored run or run it, then summarise: the one orchestrator of the compare command
(``launch/compare.py``), the evidence matrix (``bench/evidence/cells.py``) and
``bench/run_methods.py``.

A run is stored as a record, one JSON file: what the caller says about it (its row, stage,
seed...), its run config, what its numbers depend on, how long it took, and its summary
(``stats.summarize_run``), or, where the caller counts a diverged run as a result, why it
diverged. A stored record is reused only when it is *current* (``RunStore.is_current``, the
one staleness rule):

- its resolved config (the app's defaults under its run config, less the keys of other
  methods: ``fedfac.layers`` does not change a FedAvg run's numbers), filled with today's
  defaults for the keys added since (a new option whose default keeps the old behaviour is
  no change), equals today's, up to the keys that change no number
  (``stats.comparable_config``);
- and its context (what no run-config key records, such as the number of clients, which
  sets the data split) equals today's.

A run that failed is not stored (the next invocation tries it again), except a diverged one
where the caller says divergence is a result (the evidence matrix, at every stage: a
searched configuration that cannot be chosen, a run under DP noise, an ablation's change, a
report seed of a configuration chosen on another scenario). A run diverged where its clients'
losses or arrays stopped being finite: all of them (the run failed), or some of them in the
rounds its figure is computed on, the last ``LAST_ROUNDS`` evaluated ones (the run
completed, but its accuracy is over the clients that survived, once 1.0 over a single
client). A run that lost a reply to the round-timeout, in any round (``lost_to_timeout``),
failed too, whatever the caller counts as a result: every client of these runs is a
simulated one on this machine, so a reply that did not come in time says the machine stalled
(a benchmark paused while a test suite ran lost 3 evaluations so), not what the method does,
and its figures would be over fewer clients or a model without their update. A reply lost to
a client's error or refused by the server is the app's doing, the same on every try: the run
stands (or diverged) as it ran.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Protocol

from common.protocol import NOT_FINITE
from common.record import lost_to_non_finite, lost_to_timeout
from comparison.stats import LAST_ROUNDS, comparable_config, spent_privacy, summarize_run
from comparison.table import in_points


class RunOutcome(Protocol):
    """How a run ended, as the runner reports it (``launch.federation.FlowerRun``)."""

    output: str
    status: str
    reason: str

    @property
    def ok(self) -> bool: ...


# (run_config with its ``output-dir``, context) -> how the run ended
Runner = Callable[[dict[str, Any], dict[str, Any]], RunOutcome]
# a stored record of a run that completed -> its figures in the line printed as it ends
Describe = Callable[[Mapping[str, Any]], str]


def final_figures(entry: Mapping[str, Any]) -> str:
    """A run's final accuracies, in points as every table (the evidence matrix's line)."""
    return (f"accuracy {in_points(entry['accuracy_weighted'])}, min client "
            f"{in_points(entry['accuracy_min'])} (points)")


class RunStore:
    """Stored runs, reused while current, others run on ``runner`` (none: read only).

    ``defaults``: the app's run-config defaults today; ``methods``: every method's name (whose
    keys are ``<method>.<key>``); ``stamp``: what to record about the code and machine of a
    run as it starts (a commit, say); ``prefix``: of the lines it prints; ``describe``: a
    completed run's figures in the line printed as it ends (the caller's report's figures,
    in its unit)."""

    def __init__(self, defaults: Mapping[str, Any], methods: Collection[str],
                 runner: Runner | None = None, stamp: Callable[[], dict[str, Any]] | None = None,
                 prefix: str = "", describe: Describe = final_figures) -> None:
        self.defaults = dict(defaults)
        self.methods = frozenset(methods)
        self.runner = runner
        self.stamp = stamp
        self.prefix = prefix
        self.describe = describe
        self.failed: list[str] = []  # "<name>: <why>" of each run that failed here

    def resolved(self, run_config: Mapping[str, Any]) -> dict[str, Any]:
        """The config a run resolves to: the app's defaults under ``run_config``, less the
        keys of methods other than its own."""
        method = {**self.defaults, **run_config}.get("method")
        return {k: v for k, v in {**self.defaults, **run_config}.items()
                if (group := k.split(".", 1)[0]) in (k, method) or group not in self.methods}

    def is_current(self, stored: Mapping[str, Any], run_config: Mapping[str, Any],
                   context: Mapping[str, Any]) -> bool:
        """Whether a stored record holds the numbers ``run_config`` would give today."""
        return ("resolved_config" in stored
                and all(stored.get(k) == v for k, v in context.items())
                and comparable_config(self.resolved(stored["resolved_config"]))
                == comparable_config(self.resolved(run_config)))

    def get(self, record: Path, run_config: dict[str, Any], *, name: str,
            about: Mapping[str, Any] | None = None, context: Mapping[str, Any] | None = None,
            may_run: bool = True, diverged_is_result: bool = False) -> dict[str, Any] | None:
        """The record at ``record`` if it is current; else the run of ``run_config`` (into
        its ``output-dir``) when ``may_run`` and there is a runner, stored there with
        ``about`` and ``context``; None when neither (a failure is printed, and listed in
        ``failed``). ``name``: the run in printed lines."""
        context = dict(context or {})
        if record.exists():
            stored = json.loads(record.read_text())
            if self.is_current(stored, run_config, context):
                return stored
            print(f"{self.prefix}{record}: ran under another config or context (a default, "
                  "a setting or the number of clients changed since); not used",
                  file=sys.stderr)
        if self.runner is None or not may_run:
            return None
        out = Path(run_config["output-dir"])
        # a run that dies before writing its own must not be read as the run before it
        (out / "results.json").unlink(missing_ok=True)
        stamp = self.stamp() if self.stamp else {}  # the code the run starts with
        print(f"{self.prefix}{name}: running", flush=True)
        started = time.monotonic()
        run = self.runner(run_config, context)
        wall = time.monotonic() - started
        entry = {**(about or {}), "run_config": run_config,
                 "resolved_config": self.resolved(run_config), **context, **stamp,
                 "wall_seconds": wall}
        results = read_results(out)
        reason = divergence(results, completed=run.ok)
        lost = lost_to_timeout(results.get("rounds", []))
        if lost is None and run.ok and reason is None:
            entry.update(summarize_run(results))
        elif lost is None and reason is not None and diverged_is_result:
            entry.update(status="diverged", reason=reason, **spent_privacy(results))
        else:
            ended = None if run.ok else (run.reason or run.status or "did not start")
            why = "; ".join(w for w in (reason or ended, lost) if w)
            self.failed.append(f"{name}: {why}")
            if reason is None and not run.ok:  # a crash, or past the run's time limit:
                print(run.output[-3000:], file=sys.stderr)  # what it printed says why
            print(f"{self.prefix}{name}: run failed ({why}); not stored, the next "
                  "invocation tries it again", file=sys.stderr, flush=True)
            return None
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(entry, indent=1))
        figures = (f"diverged ({entry['reason']})" if "reason" in entry else
                   self.describe(entry))
        print(f"{self.prefix}{name}: {figures} {wall:.0f} s", flush=True)
        return entry


def read_results(out: Path) -> dict[str, Any]:
    """The results.json a run wrote under ``out``; empty where it wrote none."""
    path = out / "results.json"
    return json.loads(path.read_text()) if path.exists() else {}


def divergence(results: Mapping[str, Any], *, completed: bool) -> str | None:
    """Why a run diverged, from its ``results`` (``read_results``) and whether the run
    ``completed``; None where it did not diverge (a crash or a timeout is no divergence):
    it failed because no reply was left whose values were finite, or it completed but lost
    clients to values that were not finite in the rounds its figure is computed on
    (its last ``LAST_ROUNDS`` evaluated ones)."""
    if completed:
        lost = (lost_to_non_finite(results.get("rounds", []), LAST_ROUNDS)
                if results.get("status") == "completed" else None)
        return f"{lost}; the accuracy would be over the others" if lost else None
    reason = str(results.get("reason", ""))
    return reason if results.get("status") == "failed" and NOT_FINITE in reason else None

