"""results.json (contracts §4), the plot beside it, and the terminal progress lines."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.common.logger import log

from common.config import RunSettings
from common.durable import write_json
from common.record import lost_to_non_finite
from server_app.tracking import Tracking

if TYPE_CHECKING:  # the launcher reads CHECKPOINT from here without importing PyTorch
    from strategies.engine import RoundEngine

MB = 1024**2


CHECKPOINT = "checkpoint.npz"  # the server's state after each round (server_app/rounds.py)


def output_dir(settings: RunSettings) -> Path:
    if settings.output_dir:
        return Path(settings.output_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return Path("outputs") / f"{stamp}-{settings.method}"


class ResultsRecorder:
    """Writes results.json after every round: each round's ``RoundRecord`` entry
    (``common/record.py``), the run's totals and the engine's per-client tables, and the
    run's ``status``: ``running``, then ``completed`` (``finish``: every round ran and the
    last evaluation produced accuracies) or ``failed`` with its one-line ``reason``. Each
    round it writes goes to ``tracking`` too (the rounds a resumed run restores do not:
    its predecessor logged them)."""

    def __init__(self, settings: RunSettings, engine: RoundEngine,
                 out_dir: Path, tracking: Tracking) -> None:
        self.settings = settings
        self.engine = engine
        self.out_dir = out_dir
        self.tracking = tracking
        self.rounds: list[dict[str, Any]] = []
        self.extra: dict[str, Any] = {}  # after-training results (e.g. FedFac's new clients)
        self.status, self.reason = "running", ""
        self._t_start = self._t_round = time.monotonic()
        self._explained = False  # epsilon in plain words: once a run, at its first figure
        out_dir.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self.out_dir / "results.json"

    @property
    def last_round(self) -> int:
        """The last round written (0: none)."""
        return self.rounds[-1]["round"] if self.rounds else 0

    def start(self) -> None:
        """Start the round clock; write results.json (the rounds restored on resume)."""
        self._t_start = self._t_round = time.monotonic()
        self.write()

    def on_round(self, server_round: int) -> None:
        """A round is done: add its entry, rewrite results.json, print the progress line."""
        now = time.monotonic()
        record = self.engine.round_record(server_round)
        entry = record.entry(server_round, now - self._t_round)
        self._t_round = now
        if self.rounds and self.rounds[-1]["round"] == server_round:
            # written before its evaluation (evaluate-every skipped it, then the run stopped
            # after it): the entry now has it, and the time of both
            entry["seconds"] += self.rounds.pop()["seconds"]
        self.rounds.append(entry)
        self.write()
        self.tracking.log_round(entry)
        self._progress(entry)

    def _progress(self, entry: dict[str, Any]) -> None:
        acc = entry.get("eval", {})
        # one line a round: its personalized accuracy (weighted by test examples, the
        # clients' mean and lowest, the mean task accuracy), bytes and time
        log(INFO, "[progress] round %3d | acc weighted %s mean %s min %s task %s (%s clients) "
            "| up %.3f MB down %.3f MB | %.1f s%s",
            entry["round"], _fmt(acc.get("accuracy_weighted")), _fmt(acc.get("accuracy_mean")),
            _fmt(acc.get("accuracy_min")), _fmt(acc.get("accuracy_task_mean")),
            acc.get("num_clients", 0), entry.get("bytes_up", 0) / MB,
            entry.get("bytes_down", 0) / MB, entry["seconds"], _privacy(entry.get("privacy")))
        spent = entry.get("privacy")
        if spent and not self._explained and spent["epsilon"] > 0:
            self._explained = True
            grade = privacy_in_words(spent)
            log(WARNING if spent["epsilon"] > MODERATE_EPSILON else INFO, "%s", grade)

    def final(self) -> dict[str, Any]:
        evaluated = [r["eval"] for r in self.rounds if "eval" in r]
        last = evaluated[-1] if evaluated else {}
        return {
            "accuracy_weighted": last.get("accuracy_weighted"),
            "accuracy_mean": last.get("accuracy_mean"),
            "accuracy_std": last.get("accuracy_std"),
            "accuracy_min": last.get("accuracy_min"),
            "accuracy_task_mean": last.get("accuracy_task_mean"),
            "bytes_up_total": sum(r.get("bytes_up", 0) for r in self.rounds),
            "bytes_down_total": sum(r.get("bytes_down", 0) for r in self.rounds),
            "seconds_total": sum(r["seconds"] for r in self.rounds),
            # a DP run: the budget spent by the end (the last round's entry)
            **({"privacy": spent[-1]} if (spent := [r["privacy"] for r in self.rounds
                                                     if "privacy" in r]) else {}),
        }

    def payload(self) -> dict[str, Any]:
        outcome = {"status": self.status, **({"reason": self.reason} if self.reason else {})}
        return {"method": self.settings.method, **outcome, "config": dict(self.settings.raw),
                # a tuning run is scored on validation splits (validation-fraction > 0)
                "evaluated_on": "validation" if self.settings.validation_fraction else "test",
                "rounds": self.rounds, "final": self.final(), **self.extra,
                "server_state": self.engine.server_state()}

    def write(self) -> None:
        write_json(self.path, self.payload())

    def missing_evaluation(self) -> str | None:
        """Why the run cannot count as completed although every round ran: its last round
        has no accuracy (every evaluation reply was dropped); None when it has one, or when
        the run asked for no evaluation (``fraction-evaluate = 0``)."""
        last = self.rounds[-1] if self.rounds else {}
        if self.settings.fraction_evaluate == 0 or "accuracy_weighted" in last.get("eval", {}):
            return None
        drops = sorted({d["reason"] for d in last.get("dropped", [])})
        return (f"round {last.get('round', 0)}: no client's evaluation arrived"
                + (f" ({len(last.get('dropped', []))} dropped: {'; '.join(drops)[:300]})"
                   if drops else ""))

    def fail(self, reason: str, through_round: int) -> None:
        """The run stopped: results.json keeps the rounds done, the ones not written yet
        through ``through_round`` included (a round whose evaluation was still to come, the
        round that failed, with its dropped replies), with ``status`` failed and the
        one-line ``reason``."""
        for server_round in range(self.last_round + 1, through_round + 1):
            record = self.engine.round_record(server_round)
            self.rounds.append(record.entry(server_round, time.monotonic() - self._t_round))
            self.tracking.log_round(self.rounds[-1])
        self.status, self.reason = "failed", reason
        self.write()
        self.tracking.close(self.payload())
        log(ERROR, "[failed] %s", reason)

    def finish(self, extra: dict[str, Any] | None = None, reason: str = "") -> None:
        """Final write (with ``extra``: the method's after-training results, and the
        status: completed, with ``reason`` when training stopped early), plot, and the
        per-client table in the terminal."""
        self.extra.update(extra or {})
        self.status, self.reason = "completed", reason
        self.write()
        written = [self.path.name]
        if self.settings.plot and self.rounds:
            plot_results(self.payload(), self.out_dir / "results.png")
            written.append("results.png")
        if (self.out_dir / CHECKPOINT).exists():
            written.append(CHECKPOINT)
        self.tracking.close(self.payload())
        final = self.final()
        log(INFO, "[final] %s: accuracy weighted %s mean %s std %s min %s, task mean %s | "
            "%.2f MB up, %.2f MB down | %.1f s%s", self.settings.method,
            _fmt(final["accuracy_weighted"]), _fmt(final["accuracy_mean"]),
            _fmt(final["accuracy_std"]), _fmt(final["accuracy_min"]),
            _fmt(final["accuracy_task_mean"]),
            final["bytes_up_total"] / MB, final["bytes_down_total"] / MB,
            final["seconds_total"], _privacy(final.get("privacy")))
        if self.reason:
            log(INFO, "[final] training stopped early: %s", self.reason)
        # the run went on without them (one site never stops a run): say so where the
        # final figure is read, and what it means for that figure
        if lost := lost_to_non_finite(self.rounds, 1, stage="evaluate"):
            log(WARNING, "[final] %s: the accuracy above is over the other clients only", lost)
        if lost := lost_to_non_finite(self.rounds, 1, stage="train"):
            log(WARNING, "[final] %s: their updates were left out of the shared model (where "
                "training diverged, a lower lr or less DP noise helps)", lost)
        per_client = next((r["eval"]["per_client"] for r in reversed(self.rounds)
                           if "eval" in r), {})
        log(INFO, "[final] %-12s %s", "client", "accuracy")
        for client_id, accuracy in per_client.items():
            log(INFO, "[final] %-12s %.4f", client_id, accuracy)
        # the run's last line: everything it wrote, where
        log(INFO, "[final] wrote to %s: %s", self.out_dir,
            ", ".join([*written, *self.tracking.outputs]))


def _fmt(value: float | None) -> str:
    return "  -   " if value is None else f"{value:.4f}"


def _privacy(spent: dict[str, Any] | None) -> str:
    """A DP run's budget spent, for the progress and final lines ("" without DP)."""
    if not spent:
        return ""
    worst = " (the most released client)" if spent["mode"] == "local" else ""
    return (f" | epsilon {spent['epsilon']:.3f}{worst} at delta {spent['delta']:.2g} "
            f"({spent['mode']} DP)")


# What the docs call a strong, a moderate and a weak guarantee (docs/privacy.md: reading epsilon)
STRONG_EPSILON, MODERATE_EPSILON = 1.0, 10.0


def privacy_in_words(spent: dict[str, Any]) -> str:
    """One line, once a run, beside the first epsilon it reports: what epsilon bounds, and
    where this one stands."""
    epsilon = spent["epsilon"]
    grade = ("strong" if epsilon <= STRONG_EPSILON else "moderate"
             if epsilon <= MODERATE_EPSILON else "weak: past what the docs call meaningful")
    return (f"[privacy] epsilon {epsilon:.3g} at delta {spent['delta']:.2g}: changing one "
            f"client's data changes the odds of anything released by at most a factor of "
            f"e^epsilon = {math.exp(min(epsilon, 700)):.3g}, except with probability delta; "
            f"{grade} (docs/privacy.md#reading-epsilon)")


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



