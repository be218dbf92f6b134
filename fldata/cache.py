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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = 2  # bumped whenever the split rule changes: 2 keeps a test example back
# The cache keeps the splits used last, up to this many bytes on disk (a new split beyond it
# removes the ones unused the longest); empty it with `rm -rf ~/.cache/pflower/partitions`.
MAX_CACHE_BYTES = 2 * 1024**3
ARRAYS = ("x_train", "y_train", "x_test", "y_test")
DATA_KEYS = ("dataset", "data-dir", "data-root", "partitioner", "partition-column",
             "dirichlet-alpha", "min-partition-size", "classes-per-client", "domain-groups",
             "seed", "test-fraction", "validation-fraction", "permute-labels", "feature-shift",
             "feature-shift-groups", "num-classes", "input-shape", "label-column",
             "image-column")


def default_cache_dir(state_dir: str | None) -> Path:
    """``<state-dir>/partitions`` on a site with a state dir, else the user's cache."""
    if state_dir:
        return Path(state_dir) / "partitions"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pflower" / "partitions"


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
    temporary directory and renames it into place; the first rename wins."""
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
    removed split keeps reading it (the files go once no one maps them)."""
    entries, total = [], 0
    for entry in directory.iterdir():
        marker = entry / "complete"
        with contextlib.suppress(OSError):  # a split another process removes meanwhile
            if not marker.exists():
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
