"""What a run prints and how it ended, as the launchers show it: the lines left out of the echo
(Flower's and Ray's notices a user cannot act on), the ServerApp's lines the launchers read,
the run's full log written beside its results, and ``FlowerRun``, a run's outcome."""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn


@dataclass
class FlowerRun:
    """How one ``flwr run`` ended: its output and the SuperLink's status of the run."""

    # 0: the run ended (``status`` says how); 1: not started, or its SuperLink exited or could
    # not say how it ended (``output`` says why); 124: not ended within the timeout, stopped
    returncode: int
    output: str
    run_id: str | None
    status: str  # e.g. "finished:completed", "finished:failed"; "" if the run never started
    reason: str = ""  # why it failed: the ServerApp's one line (Flower's status details)
    # or, with returncode 1 after the start, the launcher's

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.status == "finished:completed"


# Flower's words before the ServerApp's exception in a failed run's status details
FAILED_WITH = re.compile(r"^\w+ failed with exception: ")
# A file a launcher appends its milestones to ("<CLOCK_BOOTTIME seconds> <what>" a line) when
# this variable names one: bench/overhead.py's timeline of a cold demo. Unset: nothing written
TIMELINE_ENV = "PFLOWER_TIMELINE"


def mark(what: str) -> None:
    """A milestone of the launcher's, with the time, in the file ``TIMELINE_ENV`` names."""
    if path := os.environ.get(TIMELINE_ENV):
        with open(path, "a") as timeline:
            timeline.write(f"{time.clock_gettime(time.CLOCK_BOOTTIME):.3f} {what}\n")


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


# A line a Ray worker printed, forwarded by the driver: "(pid=N) ..." or
# "(ClientAppActor pid=N) ...", coloured or not
RAY_WORKER_LINE = re.compile(r"^(?:\x1b\[[\d;]*m)*\((?:[\w.]+ )?pid=\d+\)")
# A line of a Ray worker that hosts no actor ("(pid=N) ..."): one of Ray's pooled workers,
# which runs none of the run's code (Flower runs every ClientApp in a ``ClientAppActor``)
RAY_POOLED_WORKER_LINE = re.compile(r"^(?:\x1b\[[\d;]*m)*\(pid=\d+\)")


def is_noise(line: str) -> bool:
    """A line of a run's stream that the echo leaves out (``FLOWER_NOISE``)."""
    return any(noise in line for noise in FLOWER_NOISE) or bool(EMPTY_LOG_LINE.match(line))


class Echo:
    """Which lines of a run's stream the echo shows, in the order they come: not Flower's and
    Ray's notices (``is_noise``); not what Ray's pooled workers print, at any time (Ray stops
    idle ones while a run goes on, and one stopped can abort with a C++ stack, "Mutex corrupt
    ... SIGABRT", which reached a clean demo's echo in CI with only the next rule in place);
    and, once the ServerApp has written its results, not what its actors print as Flower
    terminates them (the same abort: the run's work is done). A worker that crashes before it
    hosts an actor is a pooled one too: the run's failure line says what failed. An actor's
    line before the results is the run's, and shown. Every line stays in the run's output and
    its flower.log."""

    def __init__(self) -> None:
        self.results_written = False

    def shows(self, line: str) -> bool:
        shown = not is_noise(line) and not RAY_POOLED_WORKER_LINE.match(line) and not (
            self.results_written and RAY_WORKER_LINE.match(line))
        self.results_written = self.results_written or RESULTS_WRITTEN in line
        return shown


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


def exit_with(code: int, line: str, stream: Any) -> NoReturn:
    """A launcher's last ``line`` on ``stream``, then its exit with ``code``, at once: what it
    started is stopped by then, and the interpreter's teardown of the modules it imported
    (PyTorch, datasets, pandas) would cost 1.5 s more on 2 cores."""
    print(line, file=stream)
    for out in (sys.stdout, sys.stderr):
        out.flush()
    os._exit(code)
