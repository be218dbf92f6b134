"""Writing a benchmark's Markdown report: ``bench/results/<name>.md``, title, command, the code
that produced it, body."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from launch.app_project import app_packages

RESULTS = Path(__file__).resolve().parent / "results"


def produced_by(*paths: str) -> str:
    """The commit whose code is running, so that a table read later says which code its
    numbers belong to; ``-dirty`` when it runs with uncommitted changes to ``paths`` (default:
    the app and the benchmarks, not the results they rewrite)."""
    paths = paths or ("pyproject.toml", *app_packages(), "bench", ":(exclude)bench/results")
    try:
        changed = _git("status", "--porcelain", "--", *paths)
        return _git("describe", "--always", "--abbrev=7") + ("-dirty" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def numerics() -> str:
    """What a run's numbers depend on besides the code, its configuration and its seed: the
    CPU (its model, and the kernels PyTorch picks for it) and the versions of the numerical
    packages the project does not pin exactly. A run is repeatable bit for bit where these
    are the same; on another CPU it is not (``bench/README.md``, reproducibility)."""
    import numpy
    import scipy
    import torch

    model = next((line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines()
                  if line.startswith("model name")), platform.processor() or "CPU")
    return (f"{model}, PyTorch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}"
            f" kernels), numpy {numpy.__version__}, scipy {scipy.__version__}")


def gpu_name() -> str:
    """The first visible CUDA device's name, or "no CUDA device"."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"


def machine() -> str:
    """What a timing ran on: the GPU, PyTorch and its CUDA, Flower, Python, the CPU cores; and
    the commit ``PFLOWER_COMMIT`` names, where the copy that ran is not a git checkout (a
    lent GPU machine's)."""
    import flwr
    import torch

    commit = os.environ.get("PFLOWER_COMMIT", "")
    return (f"{gpu_name()}; torch {torch.__version__} (CUDA {torch.version.cuda}), flwr "
            f"{flwr.__version__}, Python {platform.python_version()}, "
            f"{os.cpu_count()} CPU cores" + (f", commit `{commit}`" if commit else ""))


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: platform.processor() names it
        return ""


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=RESULTS.parents[1], capture_output=True, text=True,
                          check=True).stdout.strip()


def write_report(name: str, title: str, command: str, body: str) -> str:
    text = f"# {title}\n\n```\n{command}\n```\n\nProduced by commit `{produced_by()}`.\n\n{body}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)
    print(text)
    return text
