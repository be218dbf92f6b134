"""A site's data computed once: its train/test split kept on disk and memory-mapped after.

Loading a pool and partitioning it costs seconds; a deployed SuperNode starts a fresh
ClientApp process for every message, and a simulation worker serves many clients. The first
message of a client writes its split (``x_train``, ``y_train``, ``x_test``, ``y_test`` as
``.npy`` files) into ``<cache dir>/<key>/``; later ones map those files instead of reloading
and re-partitioning.

The key is a hash of everything the split depends on: the data settings (dataset, data root,
its label and image columns, partitioner and its parameters, seed, test and validation
fractions, label permutation, feature shift, synthetic keys), the client's partition id and
the number of partitions, a fingerprint of the source files (path, size, modification time),
and ``FORMAT``, raised whenever the partitioning code changes what it produces. A change of
any of them gives a new key: a cached split is never reused for other settings or other data.

Where the cache lies is the site's choice, never the run config's (``site_cache_dir``): the
run config's ``data-cache`` may only turn it off. Whatever the directory, nothing is written
outside it, and pruning removes only what looks like a split this code stored there (a
directory, not a link, named like a key, holding a ``complete`` file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from common.config import ConfigError, check_data_cache

FORMAT = 2  # bumped whenever the split rule changes: 2 keeps a test example back
# The cache keeps the splits used last, up to this many bytes on disk (a new split beyond it
# removes the ones unused the longest); empty it by removing the site's cache folder.
MAX_CACHE_BYTES = 2 * 1024**3
ARRAYS = ("x_train", "y_train", "x_test", "y_test")
KEY_PATTERN = re.compile(r"[0-9a-f]{32}")  # what ``cache_key`` gives: a split's folder name
DATA_KEYS = ("dataset", "data-dir", "data-root", "partitioner", "partition-column",
             "dirichlet-alpha", "min-partition-size", "classes-per-client", "domain-groups",
             "seed", "test-fraction", "validation-fraction", "permute-labels", "feature-shift",
             "feature-shift-groups", "num-classes", "input-shape", "label-column",
             "image-column", "pool-part", "tuning-share")


def default_cache_dir(state_dir: str | None) -> Path:
    """``<state-dir>/partitions`` on a site with a state dir, else the user's cache."""
    if state_dir:
        return Path(state_dir) / "partitions"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pflower" / "partitions"


def site_cache_dir(run_setting: str, node_setting: str | None,
                   state_dir: str | None) -> Path | None:
    """The directory this site keeps its splits in, or None (no cache): all the site's.

    ``run_setting`` is the run config's ``data-cache``, written by the server's operator: it
    may only say ``""`` (the site decides) or ``"off"`` (no cache); a path is refused
    (``ConfigError``), never used. ``node_setting`` is the site's node-config ``data-cache``:
    ``"off"``, or an absolute directory (``~`` expanded). Neither set: ``default_cache_dir``
    (``<state-dir>/partitions``, else the user's cache)."""
    check_data_cache(run_setting)
    node_setting = str(node_setting) if node_setting else ""
    if run_setting == "off" or node_setting == "off":
        return None
    if not node_setting:
        return default_cache_dir(state_dir)
    directory = Path(node_setting).expanduser()
    if not directory.is_absolute():  # relative to what? A ClientApp's working directory varies
        raise ConfigError(f"node config: data-cache {node_setting!r} must be an absolute "
                          "directory or 'off'")
    return directory


def fingerprint(path: str | Path) -> list[Any]:
    """Path, size and modification time of a file, or of every file under a directory."""
    path = Path(path)
    if not path.exists():
        return [str(path), None]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def cache_key(raw: dict[str, Any], partition_id: int, num_partitions: int,
              sources: list[Any]) -> str:
    """Hash of what a client's split depends on (``raw``: the run config)."""
    data = {k: raw.get(k) for k in DATA_KEYS}
    data.update({k: v for k, v in raw.items() if k.startswith("synthetic.")})
    text = json.dumps({"format": FORMAT, "data": data, "partition-id": partition_id,
                       "num-partitions": num_partitions, "sources": sources}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_split(directory: Path, key: str,
                 compute: Callable[[], dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The split stored under ``directory/key`` (memory-mapped, copy-on-write), computing and
    storing it first if it is not there. Concurrent writers are harmless: each writes a
    temporary directory and renames it into place; the first rename wins. ``key`` is a
    ``cache_key`` (32 hex digits): the split's folder is a child of ``directory``."""
    if not KEY_PATTERN.fullmatch(key):
        raise ValueError(f"not a cache key: {key!r}")
    target = directory / key
    if not (target / "complete").exists():
        arrays = compute()
        directory.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=directory, prefix=f".{key}-"))
        try:
            for name in ARRAYS:
                np.save(tmp / f"{name}.npy", np.ascontiguousarray(arrays[name]))
            (tmp / "complete").touch()
            with contextlib.suppress(OSError):  # another process stored it first
                os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "complete").exists():  # could not store it: use it from memory
            return arrays
        prune(directory, MAX_CACHE_BYTES, keep=target)
    else:
        with contextlib.suppress(OSError):  # its last use, for prune
            os.utime(target / "complete")
    return {name: np.load(target / f"{name}.npy", mmap_mode="c") for name in ARRAYS}


def prune(directory: Path, max_bytes: int, keep: Path | None = None) -> None:
    """Remove the splits under ``directory`` unused the longest (their ``complete`` file's
    time) until the rest fit in ``max_bytes``; ``keep`` stays. A process that still maps a
    removed split keeps reading it (the files go once no one maps them).

    Only the splits this code stores count: a child of ``directory`` itself (not a link) named
    like a key and holding a ``complete`` file; nothing else there, and nothing outside it,
    is ever removed (a site may point its cache at a folder that holds other things)."""
    entries, total = [], 0
    for entry in directory.iterdir():
        if not KEY_PATTERN.fullmatch(entry.name):
            continue
        marker = entry / "complete"
        with contextlib.suppress(OSError):  # a split another process removes meanwhile
            if entry.is_symlink() or not entry.is_dir() or not marker.is_file():
                continue
            size = sum(f.stat().st_size for f in entry.iterdir())
            total += size
            if entry != keep:
                entries.append((marker.stat().st_mtime, size, entry))
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        shutil.rmtree(entry, ignore_errors=True)
        total -= size
