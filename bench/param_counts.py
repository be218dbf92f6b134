"""Parameters of each method's model against the plain backbone (no data, no training).

    python bench/param_counts.py

Prints, for the digits CNN and a CIFAR-10 ResNet-18, the parameter count of every method's
transformed model and its difference to FedAvg's, and writes bench/results/param_counts.md.
"""

from __future__ import annotations

from bench.report import write_report
from launch.app_project import app_defaults
from strategies.registry import REGISTRY, build_model, load_settings

SCENARIOS = {"digits / cnn": {"dataset": "digits", "model": "cnn"},
             "cifar10 / resnet18": {"dataset": "cifar10", "model": "resnet18"}}


def main() -> None:
    defaults = app_defaults()
    lines = ["| scenario | method | parameters | vs fedavg |", "|---|---|---|---|"]
    for label, scenario in SCENARIOS.items():
        counts = {}
        for method in REGISTRY:
            model = build_model(load_settings({**defaults, **scenario, "method": method}))
            counts[method] = sum(p.numel() for p in model.parameters())
        for method, count in counts.items():
            delta = (count - counts["fedavg"]) / counts["fedavg"]
            lines.append(f"| {label} | {method} | {count:,} | {delta:+.3%} |")
    write_report("param_counts", "Parameter counts", "python bench/param_counts.py",
                 "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
