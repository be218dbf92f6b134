"""A launcher's run config, read as users type it and checked before anything starts.

Flower reads ``--run-config`` itself, but only once a SuperLink is up and the app bundled: a
misspelled key then reads ``Invalid run configuration`` without naming it, and a bad value
costs the SuperLink's and Ray's start before the ServerApp names it. The launchers
(``launch/federation.py``, the benchmarks) check the whole run config here first, in about two
seconds, and stop with one line.
"""

from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Iterable, Mapping
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
                     num_partitions: int | None = None) -> RunSettings:
    """The app's run config with ``overrides``, checked as the ServerApp will check it, plus
    what only this machine can tell (it runs the sites of a simulation): every key known
    (the closest known key suggested), types and ranges, the names of method, dataset and
    model, and the files the config names; with ``num_partitions`` (the launcher's number of
    clients), the whole partition drawn once (``fldata.check_partition``), its warning
    printed once. Raises a one-line ``ConfigError``."""
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
    # imported here, not at the top: the registry imports PyTorch (seconds of CPU), and a
    # mistake in a general key above is reported without it
    from strategies.registry import load_settings
    settings = load_settings(run_config)
    if num_partitions is not None:
        warning = check_partition(settings, num_partitions)
        if warning is not None and warning not in _WARNED:
            _WARNED.add(warning)
            print(f"pflower: warning: {warning}", file=sys.stderr, flush=True)
    return settings
