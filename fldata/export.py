"""Write each site's share of a dataset as the site's own data folder, for a deployment whose
SuperNodes use ``data-dir`` (docker-compose, deploy/up.sh): site *i* gets partition *i* of the
run config's dataset and partitioning (train and test together: the client splits it itself,
as in simulation), as ``<out>/site-<i>/data/<dataset>.npz``.

    python -m fldata.export deploy/sites --sites 3 [key=value ...]   (run-config overrides, TOML)
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import numpy as np

from common.config import RunSettings
from fldata import partition_arrays, pool_source

ROOT = Path(__file__).resolve().parents[1]


def export_sites(out: Path, sites: int, overrides: dict | None = None) -> list[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    settings = RunSettings.from_run_config({**config, **(overrides or {})})
    name = Path(settings.dataset).stem if "/" in settings.dataset else settings.dataset
    written, source = [], pool_source(settings)
    for site in range(sites):
        x, y = partition_arrays(settings, site, sites, source)
        path = out / f"site-{site}" / "data" / f"{name}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, x=x, y=y)
        path.chmod(0o644)
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("overrides", nargs="*", help="run-config overrides as key=value (TOML)")
    args = parser.parse_args()
    overrides = tomllib.loads("\n".join(
        f'"{k}" = {v}' for k, v in (item.split("=", 1) for item in args.overrides)))
    for path in export_sites(args.out, args.sites, overrides):
        print(path)


if __name__ == "__main__":
    main()
