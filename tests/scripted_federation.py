"""A fake federation for compare's tests (test_compare_protocol.py, test_compare_rules.py):
each run writes the results.json of a run whose curve the test scripts, as the app writes it
(the parts compare reads), and no model is trained.

    federation = ScriptedFederation(lambda run_config: [0.5, 0.7])
    main([..., "num-server-rounds=2"], federation=federation)
    federation.runs  # every run config asked for
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from launch.federation import FlowerRun

DIVERGED = "round 3: no training update was accepted, 3 dropped as not finite: the run diverged"

# a run config -> its weighted accuracy per round, None (the run fails) or "diverged"
Script = Callable[[dict], list[float] | str | None]


class ScriptedFederation:
    """Each run writes the results.json of a completed run whose weighted accuracy per round
    is ``script(run_config)``'s curve (every round evaluated, its mean and minimum client
    accuracy equal to it, on validation splits where the run config has a validation
    fraction), or of a run that diverged (``"diverged"``); ``None``: the run fails. Every run
    config is remembered in ``runs``."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.runs: list[dict] = []

    def flwr_run(self, app: Path, run_config: dict, federation_config: dict,
                 timeout: float) -> FlowerRun:
        self.runs.append(run_config)
        curve = self.script(run_config)
        if curve is None:
            return FlowerRun(1, "the scripted run failed", None, "", "scripted")
        out = Path(run_config["output-dir"])
        out.mkdir(parents=True, exist_ok=True)
        if curve == "diverged":
            (out / "results.json").write_text(json.dumps(
                {"status": "failed", "reason": DIVERGED, "rounds": []}))
            return FlowerRun(0, "", "1", "finished:failed", DIVERGED)
        rounds = [{"round": r, "bytes_up": 1024,
                   "eval": {"accuracy_weighted": a, "accuracy_mean": a, "accuracy_min": a}}
                  for r, a in enumerate(curve, 1)]
        (out / "results.json").write_text(json.dumps({
            "status": "completed", "rounds": rounds,
            "evaluated_on": "validation" if run_config.get("validation-fraction") else "test",
            "final": {"accuracy_weighted": curve[-1], "accuracy_mean": curve[-1],
                      "accuracy_min": curve[-1], "bytes_up_total": 1024 * len(curve),
                      "seconds_total": 1.0}}))
        return FlowerRun(0, "", "1", "finished:completed")
