"""Fused evaluation (the evaluation after round r rides in round r+1's train messages) gives
exactly the per-client accuracies of the two-exchange protocol, with one exchange a round."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import read_results

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
@pytest.mark.parametrize("method", ["fedavg", "fedper", "feddecomp", "fedavg-ft"])
def test_fused_evaluation_equals_two_exchanges(federation, tmp_path, method):
    results = {}
    for fused in (False, True):
        out = tmp_path / str(fused)
        run = federation.run(ROOT, {"method": method, "num-server-rounds": 3,
                                    "local-epochs": 1, "output-dir": str(out), "plot": False,
                                    "fused-evaluation": fused}, num_supernodes=3)
        assert run.ok, run.output[-3000:]
        results[fused] = read_results(out)
    two, one = results[False]["rounds"], results[True]["rounds"]
    assert [r["round"] for r in one] == [1, 2, 3]
    for separate, fused in zip(two, one, strict=True):
        assert fused["eval"]["per_client"] == separate["eval"]["per_client"]
        assert fused["eval"]["num_clients"] == 3
        assert fused["train"] == separate["train"]
        assert fused["bytes_up"] == separate["bytes_up"]
    # the evaluation of rounds 1 and 2 travelled inside train messages: no evaluate downlink
    assert [r["bytes_down_evaluate"] for r in one[:2]] == [0, 0]
    assert one[2]["bytes_down_evaluate"] == two[2]["bytes_down_evaluate"] > 0
