"""The round loop, with a checkpoint after every round and resume from one.

Flower's ``Strategy.start`` always begins at round 1; resuming needs the true round numbers
(clients seed their training with them), so the ServerApp runs the loop itself: the
engine's ``plan_round`` and ``run_round`` (which, as the run's protocol has it, carries the
last round's evaluation in this round's exchange or sends an evaluate exchange after it),
then results.json and the checkpoint.

The checkpoint (``<output-dir>/checkpoint.npz``, written with ``common.durable.save_tree``:
arrays and JSON only, ``fsync``ed, atomic) holds the round number, the method and the run
config it was made with, the ids of the runs it continues (its lineage: a resumed run's
clients accept personal state saved by those runs, up to the checkpoint's round), the shared
arrays, the engine's snapshot (``RoundEngine.snapshot``, a key per collaborator: the node
directory's, the evaluation's (every client's latest accuracy, the evaluation drawn and not
yet asked), the pinned example counts, the method rule's own record under ``rule``, the
privacy spent, the sampler's state) and the rounds of results.json.
Loading it runs no code. A resume whose run
config differs from the checkpoint's in a key outside ``RESUMABLE_KEYS`` is refused with one
line naming the keys.
"""

from __future__ import annotations

from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import Array, ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config import ConfigError
from common.durable import load_tree, save_tree
from server_app.results import CHECKPOINT, ResultsRecorder
from strategies.engine import BudgetSpentError, RoundEngine, RunFailedError

# Keys a resumed run may change: how long it runs, where it writes, how long it waits, which
# rounds it evaluates, and the server's trust settings (an operator may tighten them). Any
# other difference (method, model, dataset, partitioning, seed, training) is refused.
RESUMABLE_KEYS = frozenset({
    "num-server-rounds", "output-dir", "resume-from", "round-timeout", "min-nodes", "plot",
    "tracking", "evaluate-every",
    "device", "data-cache", "max-in-flight", "identity.node-owners",
    "identity.require-registered",
    "identity.max-clients", "identity.expire-rounds", "aggregation.rule",
    "aggregation.trim-fraction", "aggregation.clip-norm", "aggregation.max-num-examples"})


def save_checkpoint(path: Path, server_round: int, arrays: ArrayRecord,
                    engine: RoundEngine, recorder: ResultsRecorder,
                    run_ids: list[str]) -> None:
    save_tree(path, {
        "round": server_round, "method": engine.settings.method,
        "config": dict(engine.settings.raw), "run_ids": run_ids,
        "arrays": {k: v.numpy() for k, v in arrays.items()},
        **engine.snapshot(server_round), "rounds": recorder.rounds})


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        older = " (a checkpoint.pkl of an older version is not loaded: a pickle can run code)"
        raise FileNotFoundError(f"resume-from: no {CHECKPOINT} in {run_dir}"
                                f"{older if (Path(run_dir) / 'checkpoint.pkl').exists() else ''}")
    return load_tree(path)


def check_resumable(checkpoint: dict[str, Any], run_config: dict[str, Any]) -> None:
    """Refuse to continue a checkpoint made with another method or run config (keys outside
    ``RESUMABLE_KEYS``), or past the run's ``num-server-rounds``: one ``ConfigError`` line
    naming the differing keys, or the rounds."""
    saved = dict(checkpoint.get("config", {}))  # the run config holds the method
    differing = sorted(k for k in set(saved) | set(run_config)
                       if k not in RESUMABLE_KEYS and saved.get(k) != run_config.get(k))
    if differing:
        changes = ", ".join(f"{k} ({saved.get(k)!r} -> {run_config.get(k)!r})"
                            for k in differing)
        raise ConfigError(f"resume-from: the checkpoint was made with a different run "
                          f"config: {changes}")
    rounds, done = run_config.get("num-server-rounds", 0), checkpoint.get("round", 0)
    if rounds < done:  # its rounds after num-server-rounds would be evaluated again
        raise ConfigError(f"resume-from: the checkpoint is at round {done}, past "
                          f"num-server-rounds={rounds}")


def resume(checkpoint: dict[str, Any], engine: RoundEngine,
           recorder: ResultsRecorder) -> tuple[int, ArrayRecord]:
    """Restore a checkpoint; returns (first round to run, shared arrays)."""
    engine.restore(checkpoint)
    recorder.rounds = list(checkpoint["rounds"])
    arrays = ArrayRecord({k: Array(v) for k, v in checkpoint["arrays"].items()})
    log(INFO, "[resume] from round %d", checkpoint["round"])
    return checkpoint["round"] + 1, arrays


def run_rounds(grid: Grid, engine: RoundEngine, recorder: ResultsRecorder,
               arrays: ArrayRecord, first_round: int, last_round: int,
               run_ids: list[str]) -> tuple[ArrayRecord, str]:
    """The rounds; the final shared arrays, and why training stopped before ``last_round``
    ("" if it did not: a DP run stops before a round that would spend more than
    ``dp.target-epsilon``). A round's record goes to results.json once the engine says it
    is complete: after its evaluate exchange, or (fused evaluation) after the next round's
    exchange, which carried its evaluation; a round ``evaluate-every`` does not evaluate,
    once it trained."""
    recorder.start()  # starts the round clock, writes results.json
    stopped = ""
    for server_round in range(first_round, last_round + 1):
        try:
            plan = engine.plan_round(grid, server_round, arrays)
        except BudgetSpentError as spent:  # raised before any message of the round went out
            if server_round == first_round:
                raise RunFailedError(str(spent), first_round - 1) from None
            stopped = str(spent)
            log(INFO, "[round %d/%d] not run: %s", server_round, last_round, stopped)
            last_round = server_round - 1
            break
        # the accuracy lines that follow read in order: say which round this one evaluates
        evaluating = ("" if plan.evaluated is None
                      else f", evaluating round {plan.evaluated}")
        log(INFO, "[round %d/%d] training%s", server_round, last_round, evaluating)
        outcome = engine.run_round(grid, plan, arrays)
        if outcome.arrays is not None:
            arrays = outcome.arrays
        for done in outcome.completed:
            recorder.on_round(done)
        save_checkpoint(recorder.out_dir / CHECKPOINT, server_round, arrays, engine,
                        recorder, run_ids)
    if engine.evaluation_pending():  # the last round's evaluation: its own exchange (fused
        # evaluation, or a round evaluate-every skipped and then a DP budget stop; none is
        # pending when a finished run is resumed with no round left to run)
        log(INFO, "[round %d/%d] evaluating", last_round, last_round)
        recorder.on_round(engine.evaluate_round(grid, last_round, arrays, last=True))
        save_checkpoint(recorder.out_dir / CHECKPOINT, last_round, arrays, engine,
                        recorder, run_ids)
    return arrays, stopped
