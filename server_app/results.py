"""results.json (contracts §4), the plot beside it, and the terminal progress lines."""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from logging import INFO
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.common.logger import log

from common.config import RunSettings
from strategies.base import PersonalizedStrategy

MB = 1024**2


def output_dir(settings: RunSettings) -> Path:
    if settings.output_dir:
        return Path(settings.output_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path("outputs") / f"{stamp}-{settings.method}"


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


class ResultsRecorder:
    """Turns the strategy's per-round history into results.json after every round.

    Its ``on_round`` is the ``evaluate_fn`` of ``Strategy.start``, which Flower calls after
    each round's evaluation (and once with round 0 before the first round).
    """

    def __init__(self, settings: RunSettings, strategy: PersonalizedStrategy,
                 out_dir: Path, plot: bool = True) -> None:
        self.settings = settings
        self.strategy = strategy
        self.out_dir = out_dir
        self.plot = plot
        self.rounds: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}  # after-training results (e.g. FedFac's new clients)
        self._t_start = self._t_round = time.monotonic()
        out_dir.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self.out_dir / "results.json"

    def on_round(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        now = time.monotonic()
        if server_round == 0:
            self._t_start = self._t_round = now
            self.write()
            return None
        record = self.strategy.history.get(server_round)
        entry: dict[str, Any] = {"round": server_round, "seconds": now - self._t_round}
        self._t_round = now
        if record is not None:
            entry.update(bytes_up=record.bytes_up,
                         bytes_down=record.bytes_down_train + record.bytes_down_evaluate,
                         bytes_down_train=record.bytes_down_train,
                         bytes_down_evaluate=record.bytes_down_evaluate)
            if record.train is not None:
                entry["train"] = record.train
            if record.eval is not None:
                entry["eval"] = record.eval
            if record.dropped:
                entry["dropped"] = record.dropped
            if record.cpu_seconds:
                entry["cpu_seconds"] = record.cpu_seconds
            entry.update(record.extra)
        self.rounds.append(entry)
        self.write()
        self._progress(entry)
        return None

    def _progress(self, entry: dict[str, Any]) -> None:
        acc = entry.get("eval", {})
        log(INFO, "[progress] round %3d | acc weighted %s min %s | up %.3f MB down %.3f MB"
            " | %.1f s",
            entry["round"], _fmt(acc.get("accuracy_weighted")), _fmt(acc.get("accuracy_min")),
            entry.get("bytes_up", 0) / MB, entry.get("bytes_down", 0) / MB, entry["seconds"])

    def final(self) -> dict[str, Any]:
        evaluated = [r["eval"] for r in self.rounds if "eval" in r]
        last = evaluated[-1] if evaluated else {}
        return {
            "accuracy_weighted": last.get("accuracy_weighted"),
            "accuracy_mean": last.get("accuracy_mean"),
            "accuracy_std": last.get("accuracy_std"),
            "accuracy_min": last.get("accuracy_min"),
            "bytes_up_total": sum(r.get("bytes_up", 0) for r in self.rounds),
            "bytes_down_total": sum(r.get("bytes_down", 0) for r in self.rounds),
            "seconds_total": sum(r["seconds"] for r in self.rounds),
        }

    def payload(self) -> dict[str, Any]:
        return {"method": self.settings.method, "config": dict(self.settings.raw),
                "rounds": self.rounds, "final": self.final(), **self.extra,
                "server_state": {"node_to_client": {str(k): v for k, v in
                                                    self.strategy.node_to_client.items()},
                                 **self.strategy.state_tables()}}

    def write(self) -> None:
        write_json_atomic(self.path, self.payload())

    def finish(self) -> None:
        """Final write, plot, and the per-client table in the terminal."""
        self.write()
        if self.plot and self.rounds:
            plot_results(self.payload(), self.out_dir / "results.png")
        final = self.final()
        log(INFO, "[final] %s: accuracy weighted %s mean %s std %s min %s | "
            "%.2f MB up, %.2f MB down | %.1f s", self.settings.method,
            _fmt(final["accuracy_weighted"]), _fmt(final["accuracy_mean"]),
            _fmt(final["accuracy_std"]), _fmt(final["accuracy_min"]),
            final["bytes_up_total"] / MB, final["bytes_down_total"] / MB,
            final["seconds_total"])
        per_client = next((r["eval"]["per_client"] for r in reversed(self.rounds)
                           if "eval" in r), {})
        log(INFO, "[final] %-12s %s", "client", "accuracy")
        for client_id, accuracy in per_client.items():
            log(INFO, "[final] %-12s %.4f", client_id, accuracy)
        log(INFO, "[final] results written to %s", self.path)


def _fmt(value: float | None) -> str:
    return "  -   " if value is None else f"{value:.4f}"


def plot_results(results: dict[str, Any], path: Path) -> None:
    """Personalized accuracy (weighted and min) and cumulative MB per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = [r for r in results["rounds"] if "eval" in r]
    fig, (ax_acc, ax_bytes) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["round"] for r in rounds]
    ax_acc.plot(xs, [r["eval"]["accuracy_weighted"] for r in rounds], label="weighted")
    ax_acc.plot(xs, [r["eval"]["accuracy_min"] for r in rounds], label="min client")
    ax_acc.set(xlabel="round", ylabel="personalized accuracy", title=results["method"])
    ax_acc.legend()
    all_rounds = results["rounds"]
    up, down, cum_up, cum_down = 0.0, 0.0, [], []
    for r in all_rounds:
        up += r.get("bytes_up", 0) / MB
        down += r.get("bytes_down", 0) / MB
        cum_up.append(up)
        cum_down.append(down)
    ax_bytes.plot([r["round"] for r in all_rounds], cum_up, label="up")
    ax_bytes.plot([r["round"] for r in all_rounds], cum_down, label="down")
    ax_bytes.set(xlabel="round", ylabel="cumulative MB")
    ax_bytes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)



