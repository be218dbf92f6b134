"""Durable files: written whole or not at all, and read back without executing code.

``write_atomic`` writes a temporary file beside the target, flushes it and ``fsync``s it and
its directory, renames it over the target and ``fsync``s the directory again: after a crash
or a power loss the target is either the old file or the new one, never a torn one. The
personal state (``client_app/runtime.py``), the server checkpoint and ``results.json`` are
written this way.

``save_tree``/``load_tree`` store a nested value (dicts with string keys, lists, tuples,
strings, numbers, booleans, None, NumPy arrays and Flower ``ArrayRecord``s) as one ``.npz``
file: the arrays as ``.npy`` entries, the structure as JSON in a ``uint8`` entry. Loading uses
``np.load(allow_pickle=False)`` and ``json``: a crafted file can fail to load, but it cannot
run code (unlike a pickle).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
from flwr.app import Array, ArrayRecord

TREE = "__tree__"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """``write(file)`` into a temporary file beside ``path``, then make it ``path``: the file
    and its directory are ``fsync``ed before the rename, the directory again after it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.",
                                     suffix=".tmp", delete=False) as tmp:
        try:
            write(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        except BaseException:
            os.unlink(tmp.name)
            raise
    try:
        _fsync_dir(path.parent)
        os.replace(tmp.name, path)
    except BaseException:
        Path(tmp.name).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_json(path: Path, payload: Any) -> None:
    write_atomic(path, lambda f: f.write(json.dumps(payload, indent=2).encode()))


def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, np.ndarray):
        name = f"a{len(arrays)}"
        arrays[name] = value
        return {"__ndarray__": name}
    if isinstance(value, ArrayRecord):
        return {"__arrayrecord__": {k: _encode(v.numpy(), arrays) for k, v in value.items()}}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("save_tree: dict keys must be strings")
        if any(k.startswith("__") for k in value):
            raise TypeError("save_tree: dict keys may not start with '__'")
        return {k: _encode(v, arrays) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, arrays) for v in value]}
    if isinstance(value, list):
        return [_encode(v, arrays) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, str | int | float | bool):
        return value
    raise TypeError(f"save_tree: cannot store a {type(value).__name__}")


def _decode(value: Any, arrays: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "__ndarray__" in value:
        return arrays[value["__ndarray__"]]
    if "__arrayrecord__" in value:
        return ArrayRecord({k: Array(_decode(v, arrays))
                            for k, v in value["__arrayrecord__"].items()})
    if "__tuple__" in value:
        return tuple(_decode(v, arrays) for v in value["__tuple__"])
    return {k: _decode(v, arrays) for k, v in value.items()}


def save_tree(path: Path, tree: Any) -> None:
    """``tree`` as one ``.npz`` file, written with ``write_atomic``."""
    arrays: dict[str, np.ndarray] = {}
    structure = json.dumps(_encode(tree, arrays)).encode()
    arrays[TREE] = np.frombuffer(structure, dtype=np.uint8)
    write_atomic(path, lambda f: np.savez(f, **arrays))


def load_tree(path: Path) -> Any:
    """What ``save_tree`` stored (arrays and JSON only; no code runs)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    structure = json.loads(arrays.pop(TREE).tobytes().decode())
    return _decode(structure, arrays)
