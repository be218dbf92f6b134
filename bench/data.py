"""Make sure a benchmark's dataset is on this machine before it runs.

    python -m bench.data                          # fashion-mnist, installing it if it can
    python -m bench.data --no-install --data-root /data

Fashion-MNIST is looked for where the app looks (``fldata.idx.search_dirs``: ``data-root``,
or ``$PFLOWER_DATA_ROOT/fashion-mnist``, ``~/.cache/pflower/fashion-mnist`` and the Debian
package's folder). When it is missing and ``data-root`` is empty, the Debian package
``dataset-fashion-mnist`` is installed if this process can (root and ``apt-get``); otherwise
one line says what to run. Prints the folder found and exits 0, or exits 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from fldata import DATASETS
from fldata.idx import find_idx_dir, search_dirs

ROOT = Path(__file__).resolve().parents[1]

PACKAGES = {"fashion-mnist": "dataset-fashion-mnist"}  # Debian packages of IDX datasets


def _apt_install(package: str) -> str:
    """Install ``package`` with apt-get (updating the package lists once if it is unknown);
    returns "" or the last line of apt-get's complaint."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = None
    for command in (["apt-get", "install", "-y", "-q", package], ["apt-get", "update", "-q"],
                    ["apt-get", "install", "-y", "-q", package]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode == 0 and command[1] == "install":
            return ""
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"apt-get exited with {done.returncode}"


def ensure_dataset(dataset: str = "fashion-mnist", data_root: str = "",
                   install: bool = True) -> Path | None:
    """The folder of ``dataset``'s IDX files that a run with this ``data-root`` will read,
    installing the Debian package first if needed and possible; None (after one line on
    stderr saying what to do) if there is none."""
    system_dir = DATASETS[dataset].system_dir
    found = find_idx_dir(dataset, data_root, system_dir)
    if found is not None:
        return found
    package = PACKAGES.get(dataset)
    can_install = (package is not None and not data_root and hasattr(os, "geteuid")
                   and os.geteuid() == 0 and shutil.which("apt-get") is not None)
    problem = ""
    if install and can_install:
        problem = _apt_install(package)
        found = find_idx_dir(dataset, data_root, system_dir)
        if found is not None:
            return found
    where = " or ".join(str(d) for d in search_dirs(dataset, data_root, system_dir))
    todo = (f"sudo apt-get install -y {package}" if package and not data_root
            else f"put the four IDX files (train-images-idx3-ubyte[.gz], ...) in {where}")
    fallback = "" if data_root else " (runs download it from the hub without it)"
    print(f"{dataset}: not found in {where}" + (f" ({problem})" if problem else "")
          + f"; run: {todo}{fallback}", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="fashion-mnist",
                        choices=[name for name, info in DATASETS.items() if info.idx])
    parser.add_argument("--data-root", default="", help="the run's data-root (default: search)")
    parser.add_argument("--no-install", action="store_true",
                        help="only look, never install the Debian package")
    args = parser.parse_args()
    found = ensure_dataset(args.dataset, args.data_root, install=not args.no_install)
    if found is None:
        sys.exit(1)
    print(found)


if __name__ == "__main__":
    main()
