"""bench/overhead.py's timed runs: on ``--device cuda`` each simulated client gets its share of
the GPU (without one Ray hides the GPU and the client refuses ``device=cuda``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.overhead import timed_run
from launch.federation import FlowerRun


class _RecordingFederation:
    """A run that completes at once with two rounds of 1.5 s; the GPU share asked is kept."""

    def __init__(self) -> None:
        self.gpu_shares: list[float] = []

    def run(self, app: Path, run_config: dict, num_supernodes: int, gpus_per_client: float,
            timeout: float) -> FlowerRun:
        self.gpu_shares.append(gpus_per_client)
        out = Path(run_config["output-dir"])
        out.mkdir(parents=True)
        (out / "results.json").write_text(json.dumps({"rounds": [{"seconds": 1.5}] * 2}))
        return FlowerRun(0, "", "1", "finished:completed", "")


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_a_timed_run_on_cuda_gives_each_client_its_share_of_the_gpu(device, tmp_path):
    federation = _RecordingFederation()
    _, rounds = timed_run(federation, {"method": "fedavg", "device": device}, 20,
                          tmp_path / "out")
    [share] = federation.gpu_shares
    assert rounds == 3.0
    assert share * (os.cpu_count() or 1) == (pytest.approx(1) if device == "cuda" else 0)
