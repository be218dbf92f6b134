"""A launcher's run config, read as users type it and checked before the run starts.

Flower reads ``--run-config`` itself, but only once a SuperLink is up and the app bundled: a
misspelled key then reads ``Invalid run configuration`` without naming it, and a bad value
costs the SuperLink's and Ray's start before the ServerApp names it. The launchers
(``launch/federation.py``, the benchmarks) check the whole run config here first and stop with
one line: the general keys at once; the method, model and partition (seconds of CPU for
PyTorch's and the datasets' imports) while the demo's SuperLink starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import tomllib
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from common.config import ConfigError, RunSettings, did_you_mean
from fldata import DATASETS, check_dataset, check_local_files, check_partition, is_hub_id
from launch.app_project import app_defaults
from server_app.results import CHECKPOINT
from server_app.tracking import check_installed

# the partition warnings this process printed: each once, however many runs it checks
_WARNED: set[str] = set()

# what a bare word may hold to be taken as a string: no spaces, quotes or brackets
_BARE_WORD = re.compile(r"""[^\s"'\[\]{}]+""")


def parse_overrides(items: Iterable[str], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``key=value`` words as people type them: a TOML value (``lr=0.1``, ``plot=false``,
    ``method='"fedper"'``), else a bare word, taken as a string (``method=fedper``,
    ``data-root=/data/fm``); a key whose default is a string takes the word as written
    (``fedfac.layers=0``). A word that is neither raises a ``ConfigError`` naming its key."""
    overrides: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"{item!r}: an override is key=value, e.g. method=fedper")
        try:
            value = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            if not _BARE_WORD.fullmatch(text):
                raise ConfigError(f"{name}: cannot read the value {text!r}; write a string "
                                  f"as {name}=word or {name}='\"words with spaces\"'") from None
            value = text
        if isinstance(defaults.get(name), str) and not isinstance(value, str):
            value = text
        overrides[name] = value
    return {name: (from_caller(name, value) if name in PATH_KEYS else value)
            for name, value in overrides.items()}


# keys whose value is a path on this machine, as typed relative to where the user ran the
# command (the scripts run from the checkout: they pass that folder as CALLER_DIR_ENV)
PATH_KEYS = ("dataset", "data-root", "resume-from")
CALLER_DIR_ENV = "PFLOWER_CALLER_DIR"


def from_caller(name: str, value: Any) -> Any:
    """A relative path ``value`` of key ``name`` made absolute against the folder the user
    ran the command in: always when it exists there; else unless it is a named dataset or
    has a hub id's ``org/name`` form (then it stays a hub id, and the ServerApp says so)."""
    if not isinstance(value, str) or not value or Path(value).is_absolute():
        return value
    if name == "dataset" and value in DATASETS:
        return value
    caller = Path(os.environ.get(CALLER_DIR_ENV) or os.getcwd())
    local = caller / value
    if local.exists() or not (name == "dataset" and is_hub_id(value)):
        return str(local.resolve())
    return value


def check_run_config(overrides: Mapping[str, Any], app_dir: str | Path = ".",
                     num_partitions: int | None = None,
                     meanwhile: Callable[[], object] | None = None, fork: bool = False
                     ) -> RunSettings:
    """The app's run config with ``overrides``, checked as the ServerApp will check it, plus
    what only this machine can tell (it runs the sites of a simulation): every key known
    (the closest known key suggested), types and ranges, the names of method, dataset and
    model, and the files the config names; with ``num_partitions`` (the launcher's number of
    clients), the whole partition drawn once (``fldata.check_partition``), its warning
    printed once. Raises a one-line ``ConfigError``.

    In two halves: the general keys, without PyTorch (well under a second); then the method,
    the model and the rules across keys (the method registry imports PyTorch, about 1.5 s of
    CPU) and the partition (on the general keys alone: about 2.5 s of CPU for the datasets'
    imports). ``meanwhile()`` is called between the two (the demo's launcher starts its
    SuperLink). ``fork``: the partition drawn in a child forked from this process, beside the
    method's check (``_PartitionDraw``), for a caller that has started no thread, not even a
    native one (PyTorch's, gRPC's, Ray's): the demo's launcher. A mistake of the method's is
    said first either way."""
    run_config = _check_general(overrides, app_dir)
    if meanwhile is not None:
        meanwhile()
    draw = None
    if num_partitions is not None:
        draw = _PartitionDraw(RunSettings.from_run_config(run_config), num_partitions, fork)
    try:
        # imported here, not at the top: the registry imports PyTorch (seconds of CPU), and a
        # mistake in a general key is reported without it
        from strategies.registry import load_settings
        settings = load_settings(run_config)
        warning = draw.result() if draw is not None else None
    finally:
        if draw is not None:
            draw.stop()
    if warning is not None and warning not in _WARNED:
        _WARNED.add(warning)
        print(f"pflower: warning: {warning}", file=sys.stderr, flush=True)
    return settings


def _check_general(overrides: Mapping[str, Any], app_dir: str | Path) -> dict[str, Any]:
    """``check_run_config``'s first half: every key known, the general keys' types and
    ranges, the dataset's name and the files the config names, a resumed run's checkpoint,
    the trackers installed. Returns the whole run config (the defaults with ``overrides``)."""
    defaults = app_defaults(Path(app_dir).resolve())
    for name in overrides:
        if name not in defaults:
            raise ConfigError(f"{name}: unknown key{did_you_mean(name, defaults)} (the keys are "
                              "[tool.flwr.app.config] in pyproject.toml)")
    run_config = {**defaults, **overrides}
    general = RunSettings.from_run_config(run_config)  # files first: the model reads them
    check_local_files(general)
    check_dataset(general)  # load_settings checks it too; here it needs no PyTorch
    if general.resume_from and not (Path(general.resume_from) / CHECKPOINT).exists():
        raise ConfigError(f"resume-from: no {CHECKPOINT} in {general.resume_from}")
    check_installed(general.trackers())  # in a simulation the ServerApp runs here
    return run_config


class _PartitionDraw:
    """``fldata.check_partition(settings, num_partitions)``; with ``fork``, in a child forked
    from this process, beside the caller's own work (its imports, scikit-learn's and
    datasets', take the other core). In this process, when ``result`` is asked, without
    ``fork``, where another Python thread runs (a fork copies no thread, and could copy a
    lock one holds) or where there is no ``os.fork``."""

    def __init__(self, settings: RunSettings, num_partitions: int, fork: bool) -> None:
        self.settings, self.num_partitions = settings, num_partitions
        self.pid: int | None = None
        if not fork or threading.active_count() > 1 or not hasattr(os, "fork"):
            return
        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: the draw's outcome on the pipe, then exit at once
            try:
                os.close(read_end)
                with os.fdopen(write_end, "w") as pipe:
                    json.dump(self._draw(), pipe)
            finally:
                os._exit(0)
        os.close(write_end)
        self.pipe = os.fdopen(read_end)

    def _draw(self) -> dict[str, str | None]:
        try:
            return {"warning": check_partition(self.settings, self.num_partitions)}
        except ConfigError as error:
            return {"refused": str(error)}
        except Exception:
            return {"failed": traceback.format_exc()}

    def result(self) -> str | None:
        """The draw's warning (or None); raises the ``ConfigError`` that refused it."""
        if self.pid is None:
            return check_partition(self.settings, self.num_partitions)
        outcome = json.loads(self.pipe.read() or '{"failed": "the draw\'s process exited"}')
        if "refused" in outcome:
            raise ConfigError(outcome["refused"])
        if "failed" in outcome:
            raise RuntimeError(f"drawing the partition failed:\n{outcome['failed']}")
        return outcome["warning"]

    def stop(self) -> None:
        """The child stopped (at once, where its outcome is no longer wanted) and reaped."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        self.pipe.close()
        self.pid = None
