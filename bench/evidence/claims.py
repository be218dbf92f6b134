"""The papers' claims, each judged on the report's means."""

from __future__ import annotations

from typing import Any

from bench.evidence import protocol
from bench.evidence.protocol import SAME_SIZE_RANDOM_SPLIT
from launch.comparison import config_tag


def claims(stats: dict[str, dict[str, dict[str, Any]]],
           ablated: dict[tuple[str, str, str], dict[str, Any]] | None = None) -> list[str]:
    """Each paper claim checked against the table's means (and, for FedFac's split, its
    same-size random split in ``ablated``); "not measured" where a row or that reference is
    missing. Points are accuracy percentage points."""

    def every_seed(result: dict[str, Any] | None) -> bool:
        """A verdict needs every report seed of a row or reference."""
        return bool(result) and result["seeds"] == len(protocol.REPORT_SEEDS)

    def complete(scenario: str, label: str) -> dict[str, Any] | None:
        """The row if it is tuned and has every report seed."""
        row = stats.get(scenario, {}).get(label)
        return row if every_seed(row) and row["tuned"] else None

    def acc(scenario: str, label: str) -> float | None:
        row = complete(scenario, label)
        return None if row is None else 100 * row["accuracy"][0]

    def same_size_random(label: str) -> float | None:
        """FedFac's split claim's reference: its row's random split of the same size."""
        found = (ablated or {}).get(("synthetic-fedfac", label,
                                     config_tag(SAME_SIZE_RANDOM_SPLIT)))
        return 100 * found["accuracy"][0] if every_seed(found) else None

    def verdict(name: str, values: list[float | None], held: Any, detail: str) -> str:
        if any(v is None for v in values):
            return f"- {name}: **not measured** (rows missing or incomplete)"
        result = "held" if held(*values) else "did not hold"
        return f"- {name}: **{result}** ({detail.format(*values)})"

    out = [
        verdict("FedDecomp >= FedAvg + 5 points on Dirichlet 0.1",
                [acc("dirichlet-0.1", "feddecomp"), acc("dirichlet-0.1", "fedavg")],
                lambda a, b: a >= b + 5, "{:.1f} vs {:.1f}"),
        verdict("FedDecomp not below the best of FedPer/FedRep by more than 1 point",
                [acc("dirichlet-0.1", "feddecomp"), acc("dirichlet-0.1", "fedper"),
                 acc("dirichlet-0.1", "fedrep")],
                lambda a, b, c: a >= max(b, c) - 1, "{:.1f} vs FedPer {:.1f}, FedRep {:.1f}"),
        verdict("pFedC >= FedAvg + 5 points on pathological-2",
                [acc("pathological-2", "pfedc"), acc("pathological-2", "fedavg")],
                lambda a, b: a >= b + 5, "{:.1f} vs {:.1f}"),
        verdict("pFedC not below FedRep by more than 1 point on pathological-2",
                [acc("pathological-2", "pfedc"), acc("pathological-2", "fedrep")],
                lambda a, b: a >= b - 1, "{:.1f} vs {:.1f}"),
    ]
    ffl = complete("permuted-labels", "factorized-fl")
    avg = complete("permuted-labels", "fedavg")
    out.append(verdict(
        "Factorized-FL >= Local - 1 point on permuted labels at <= 1/20 of FedAvg's uplink",
        [acc("permuted-labels", "factorized-fl"), acc("permuted-labels", "local"),
         ffl and ffl["mb_up"][0], avg and avg["mb_up"][0]],
        lambda a, b, u, f: a >= b - 1 and u <= f / 20,
        "{:.1f} vs Local {:.1f}; uplink {:.2f} vs FedAvg {:.2f} MB"))
    for label in ("fedfac", "fedfac@dynamic"):
        out.append(verdict(f"FedFac ({label}) >= FedAvg + 3 points on Dirichlet 0.1",
                           [acc("dirichlet-0.1", label), acc("dirichlet-0.1", "fedavg")],
                           lambda a, b: a >= b + 3, "{:.1f} vs {:.1f}"))
        out.append(verdict(f"FedFac ({label}) split at least as good as a random split "
                           "of the same size (eq. 8 simulation)",
                           [acc("synthetic-fedfac", label), same_size_random(label)],
                           lambda a, b: a >= b, "{:.1f} vs random {:.1f}"))
    return out


