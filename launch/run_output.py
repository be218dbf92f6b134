"""What a run prints, as the launchers show it: the lines left out of the echo (Flower's and
Ray's notices a user cannot act on), the ServerApp's lines the launchers read, and the run's
full log written beside its results."""

from __future__ import annotations

import re
from pathlib import Path

# The ServerApp's last line of a completed run (server_app/results.py): the run's work is done
RESULTS_WRITTEN = "[final] wrote to "
# The ServerApp's first line names the folder the run writes to (server_app/app.py)
RESULTS_FOLDER = re.compile(r"\[start\] .*, results in (.+?)\s*$")
RUN_LOG = "flower.log"  # the run's whole stream, noise included, beside its results
# Lines Flower and Ray print for every simulation that a user cannot act on: left out of the
# echoed stream, kept in ``FlowerRun.output`` (and the demo's flower.log). The federation's
# size is set per run; the app is installed into a private FLWR_HOME per run; the actors'
# "Manually terminating" warning is Flower's normal shutdown of its Ray actors; Ray's tip
# about its future GPU default is filtered where it is raised (``LocalFederation.env``).
FLOWER_NOISE = ("default simulated SuperNodes changed from 10 to 2",
                "To change federation size, use the following command",
                "flwr federation simulation-config @none/default <superlink>",
                "Successfully installed pflower to ",
                "Manually terminating ClientAppActor")
# Flower's empty log line at the end of a simulation
EMPTY_LOG_LINE = re.compile(r"^(\x1b\[\d+m)?INFO (\x1b\[0m)?:\s*$")
# Ray's FutureWarning, raised in flwr-simulation's ray.init() on every run, about a default
# that changes in a later Ray. Its only off switch (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0)
# would take the behaviour it announces now: clients given no GPU would see every GPU.
# Filtered by its words, module and category only.
RAY_GPU_TIP = "ignore:Tip:FutureWarning:ray._private.worker"


def is_noise(line: str) -> bool:
    """A line of a run's stream that the echo leaves out (``FLOWER_NOISE``)."""
    return any(noise in line for noise in FLOWER_NOISE) or bool(EMPTY_LOG_LINE.match(line))


def save_run_log(output: str) -> Path | None:
    """A run's whole stream (``output``), the lines the echo left out included, written
    beside its results (the folder its ServerApp's first line names); None when it never
    said."""
    found = next((m for line in output.splitlines() if (m := RESULTS_FOLDER.search(line))),
                 None)
    if found is None:
        return None
    path = Path(found.group(1)) / RUN_LOG
    try:
        path.write_text(output)
    except OSError:
        return None
    return path
