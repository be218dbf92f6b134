"""The round loop, with a checkpoint after every round and resume from one.

Flower's ``Strategy.start`` always begins at round 1; resuming needs the true round numbers
(clients seed their training with them), so the ServerApp runs the loop itself: the
strategy's ``train_round`` then ``evaluate_round``, then results.json and the checkpoint.

The checkpoint (``<output-dir>/checkpoint.pkl``, written atomically) holds the round number,
the ids of the runs it continues (its lineage: a resumed run's clients accept personal state
saved by those runs, up to the checkpoint's round), the shared arrays, the strategy's
per-client tables (``Strategy.checkpoint_state``), the rounds of results.json and the
sampler's random state. It is a pickle: load only your own.
"""

from __future__ import annotations

import os
import pickle
import random
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import Array, ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from server_app.results import ResultsRecorder
from strategies.personalized import PersonalizedStrategy

CHECKPOINT = "checkpoint.pkl"


def save_checkpoint(path: Path, server_round: int, arrays: ArrayRecord,
                    strategy: PersonalizedStrategy, recorder: ResultsRecorder,
                    run_ids: list[str]) -> None:
    payload = {"round": server_round, "run_ids": run_ids,
               "arrays": {k: v.numpy() for k, v in arrays.items()},
               "strategy": strategy.checkpoint_state(), "rounds": recorder.rounds,
               "pending_evaluation": strategy.pending_state(server_round),
               "random": random.getstate()}
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as file:
        pickle.dump(payload, file, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / CHECKPOINT
    if not path.exists():
        raise FileNotFoundError(f"resume-from: no {CHECKPOINT} in {run_dir}")
    with open(path, "rb") as file:
        return pickle.load(file)


def resume(checkpoint: dict[str, Any], strategy: PersonalizedStrategy,
           recorder: ResultsRecorder) -> tuple[int, ArrayRecord]:
    """Restore a checkpoint; returns (first round to run, shared arrays)."""
    strategy.restore_state(checkpoint["strategy"])
    strategy.restore_pending(checkpoint.get("pending_evaluation"))
    recorder.rounds = list(checkpoint["rounds"])
    random.setstate(checkpoint["random"])
    arrays = ArrayRecord({k: Array(v) for k, v in checkpoint["arrays"].items()})
    log(INFO, "[resume] from round %d", checkpoint["round"])
    return checkpoint["round"] + 1, arrays


def run_rounds(grid: Grid, strategy: PersonalizedStrategy, recorder: ResultsRecorder,
               arrays: ArrayRecord, first_round: int, last_round: int,
               run_ids: list[str]) -> ArrayRecord:
    fused = strategy.settings.fused_evaluation
    recorder.start()  # starts the round clock, writes results.json
    for server_round in range(first_round, last_round + 1):
        log(INFO, "[round %d/%d]", server_round, last_round)
        updated = strategy.train_round(grid, server_round, arrays)
        if updated is not None:
            arrays = updated
        if not fused:
            strategy.evaluate_round(grid, server_round, arrays)
            recorder.on_round(server_round)
        elif server_round - 1 > recorder.last_round:  # its evaluation came with this exchange
            recorder.on_round(server_round - 1)
        save_checkpoint(recorder.out_dir / CHECKPOINT, server_round, arrays, strategy,
                        recorder, run_ids)
    if fused:  # the last round's evaluation: its own exchange
        strategy.evaluate_round(grid, last_round, arrays)
        recorder.on_round(last_round)
        save_checkpoint(recorder.out_dir / CHECKPOINT, last_round, arrays, strategy,
                        recorder, run_ids)
    return arrays
