"""The IDX format of MNIST and Fashion-MNIST, read with NumPy, and where local copies live.

An IDX file is a header and a C-order array, everything big-endian: two zero bytes, a type
code (0x08 unsigned byte, 0x09 signed byte, 0x0B int16, 0x0C int32, 0x0D float32,
0x0E float64), the number of dimensions ``d``, ``d`` sizes as unsigned 32-bit integers, then
the values. The standard layout is four files, each possibly gzipped (``<name>.gz``).
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
GZIP_MAGIC = b"\x1f\x8b"
ENV_ROOT = "PFLOWER_DATA_ROOT"


class IdxError(ValueError):
    """An IDX file is truncated, corrupt or not what the dataset needs (one line, naming the
    file)."""


def _raw_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix != ".gz" and not data.startswith(GZIP_MAGIC):
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as error:
        raise IdxError(f"{path}: not a readable gzip file (truncated or corrupt: "
                       f"{error})") from None


def read_idx(path: str | Path) -> np.ndarray:
    """The array in one IDX file (plain or gzipped), in native byte order.

    The header is checked against the file: magic, type code, and that the sizes account
    for exactly the bytes that follow."""
    path = Path(path)
    raw = _raw_bytes(path)
    if len(raw) < 4 or raw[:2] != b"\0\0":
        raise IdxError(f"{path}: not an IDX file (magic {raw[:4].hex() or 'missing'}, "
                       "expected 0000<type><dims>)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_TYPES:
        raise IdxError(f"{path}: unknown IDX type code 0x{code:02x}; allowed: "
                       f"{', '.join(f'0x{c:02x}' for c in IDX_TYPES)}")
    if ndim == 0:
        raise IdxError(f"{path}: IDX header gives 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise IdxError(f"{path}: truncated IDX header ({len(raw)} bytes, {ndim} dimensions "
                       f"need {header})")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    dtype = np.dtype(IDX_TYPES[code])
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        state = "truncated" if len(raw) < expected else "has trailing bytes"
        raise IdxError(f"{path}: {state}: {len(raw)} bytes, the header "
                       f"({'x'.join(map(str, dims))} of {dtype.name}) says {expected}")
    return np.frombuffer(raw, dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="))


def idx_file(directory: Path, name: str) -> Path | None:
    """``directory/name`` or ``directory/name.gz``, whichever is there (plain first)."""
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def holds_idx(directory: str | Path) -> bool:
    """Whether ``directory`` holds the four standard IDX files (plain or gzipped)."""
    directory = Path(directory)
    return directory.is_dir() and all(idx_file(directory, name) is not None
                                      for pair in SPLITS.values() for name in pair)


def read_idx_split(directory: str | Path, split: str = "train") -> tuple[np.ndarray,
                                                                         np.ndarray]:
    """One split's raw images (N, H, W) and labels (N,) from a directory of IDX files."""
    directory = Path(directory)
    paths = []
    for name in SPLITS[split]:
        path = idx_file(directory, name)
        if path is None:
            raise FileNotFoundError(f"dataset: no {name} (or {name}.gz) in {directory}")
        paths.append(path)
    images, labels = read_idx(paths[0]), read_idx(paths[1])
    if images.ndim != 3:
        raise IdxError(f"{paths[0]}: expected images (N, H, W), the header gives "
                       f"{images.shape}")
    if labels.ndim != 1 or len(labels) != len(images):
        raise IdxError(f"{paths[1]}: expected {len(images)} labels (as many as images in "
                       f"{paths[0].name}), the header gives {labels.shape}")
    return images, labels


def search_dirs(dataset: str, data_root: str = "", system_dir: str = "") -> list[Path]:
    """Where a local copy of ``dataset`` is looked for, in order.

    ``data_root`` set: ``<data_root>/<dataset>``, then ``data_root`` itself. Empty:
    ``$PFLOWER_DATA_ROOT/<dataset>`` (if the variable is set), ``~/.cache/pflower/<dataset>``,
    then ``system_dir`` (where a system package installs it), if given."""
    if data_root:
        root = Path(data_root).expanduser()
        return [root / dataset, root]
    dirs = []
    if os.environ.get(ENV_ROOT):
        dirs.append(Path(os.environ[ENV_ROOT]).expanduser() / dataset)
    dirs.append(Path("~/.cache/pflower").expanduser() / dataset)
    if system_dir:
        dirs.append(Path(system_dir))
    return dirs


def find_idx_dir(dataset: str, data_root: str = "", system_dir: str = "") -> Path | None:
    """The first of ``search_dirs`` that holds the four IDX files, or None."""
    return next((d for d in search_dirs(dataset, data_root, system_dir) if holds_idx(d)), None)
