"""Requests to a SuperLink's Control API, as the ``flwr`` CLI sends them: start a run from an
app folder, list runs, read one run's record, ask whether it has finished (``LocalFederation``
uses them in-process instead of starting a ``flwr`` process per run), and read a run's log
so far (``run_log``) or as it streams (``LogStream``)."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launch.run_output import RESULTS_WRITTEN, Echo


def list_runs(control: Any, run_id: str | None) -> list[dict[str, str]]:
    """``runs`` through an open Control API client."""
    import httpx
    from flwr.cli.run_utils import format_runs
    from flwr.common.serde import run_from_proto
    from flwr.proto.control_pb2 import ListRunsRequest

    request = ListRunsRequest(run_id=int(run_id)) if run_id is not None else ListRunsRequest()
    try:
        listed = control.ListRuns(request)
    except httpx.HTTPStatusError as error:
        if error.response.status_code == 404:  # the SuperLink does not know run_id
            return []
        raise
    rows = format_runs([run_from_proto(run) for run in listed.run_dict.values()], listed.now)
    return [{"run-id": str(row.run_id), "status": row.status_text,
             "status-details": row.details} for row in rows]


def start_run(control: Any, app: Path, run_config: dict[str, Any],
               federation: dict[str, Any]) -> int:
    """``flwr run``'s request (``flwr.cli.run``): the app's FAB, the run-config overrides and
    the simulation's config; the run's id."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.serde import fab_to_proto, user_config_to_proto
    from flwr.proto.control_pb2 import StartRunRequest
    from flwr.supercore.fab import Fab
    from flwr.supercore.utils import simulation_config_from_json

    fab_bytes = build_fab_from_disk(app)
    fab = Fab(hashlib.sha256(fab_bytes).hexdigest(), fab_bytes, {})
    simulation = (simulation_config_from_json({key.replace("-", "_"): value
                                               for key, value in federation.items()})
                  if federation else None)
    response = control.StartRun(StartRunRequest(
        fab=fab_to_proto(fab), override_config=user_config_to_proto(run_config),
        federation="", override_federation_config=simulation))
    if not response.HasField("run_id"):
        raise ValueError("the SuperLink did not start the run")
    return response.run_id


def run_record(control: Any, run_id: str, attempts: int = 3
                ) -> tuple[dict[str, str] | None, str]:
    """The run's record (``runs``), asked up to ``attempts`` times, and why it could not be
    read (None, the reason: the SuperLink busy or unreachable each time, or no such run)."""
    import httpx

    reason = ""
    for attempt in range(attempts):
        try:
            runs = list_runs(control, run_id)
            return (runs[0], "") if runs else (None, f"the SuperLink has no run {run_id}")
        except (httpx.HTTPError, OSError) as error:
            reason = str(error) or type(error).__name__
            if attempt + 1 < attempts:
                time.sleep(attempt + 1)
    return None, reason


def finished(control: Any, run_id: str) -> bool:
    """Whether the SuperLink has recorded the run's end; a question it cannot answer now
    (busy, a dropped connection) is asked again at the next poll."""
    run, _ = run_record(control, run_id, attempts=1)
    return run is not None and run["status"].startswith("finished")


def run_log(control: Any, run_id: str) -> str:
    """What the run has logged so far, as ``flwr log RUN_ID --show`` prints it: the first
    answer of ``StreamLogs`` from the start (the SuperLink sends all it has, then follows).
    Waits for the run's first line: a caller that must not wait bounds it (closing
    ``control`` ends the wait)."""
    from flwr.proto.control_pb2 import StreamLogsRequest

    with contextlib.closing(control.StreamLogs(
            StreamLogsRequest(run_id=int(run_id), after_timestamp=0.0))) as stream:
        first = next(stream, None)
    return first.log_output if first is not None else ""


class LogStream:
    """A run's log, read through ``StreamLogs`` in a background thread (``start``) until the
    SuperLink ends the stream at the run's end; ``echo`` prints its lines (less Flower's
    noise), ``on_results`` is called on the line that says results.json is written."""

    def __init__(self, control_client: Callable[[], Any], run_id: str, echo: bool,
                 on_results: Callable[[], None]) -> None:
        self.control_client = control_client
        self.run_id = run_id
        self.echo = echo
        self.on_results = on_results
        self.lines: list[str] = []
        self.ended = threading.Event()  # the SuperLink ended the stream (not a broken one)
        self.thread = threading.Thread(target=self._read, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def reading(self) -> bool:
        return self.thread.is_alive()

    def wait(self, seconds: float) -> None:
        """Until the reader stops or ``seconds`` pass."""
        self.thread.join(seconds)

    def output(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        import httpx
        from flwr.proto.control_pb2 import StreamLogsRequest

        try:
            with self.control_client() as control:
                echo = Echo()
                for response in control.StreamLogs(
                        StreamLogsRequest(run_id=int(self.run_id), after_timestamp=0.0)):
                    for line in response.log_output.splitlines(keepends=True):
                        self.lines.append(line)
                        if echo.shows(line) and self.echo:
                            print(line, end="", flush=True)
                        if RESULTS_WRITTEN in line:
                            self.on_results()
            self.ended.set()
        except (OSError, httpx.HTTPError):  # the status poll still sees the run's end
            pass
