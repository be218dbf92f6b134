"""The statistics of a comparison of methods over seeds, one implementation for the compare
command (``launch/compare.py``) and the evidence matrix (``bench/evidence``).

- What a run's numbers depend on is its config less the keys that change no number
  (``comparable_config``); ``comparison/runs.py`` reuses a stored run by it.
- A run is summarized from its results.json (``summarize_run``): its accuracy curve
  (personalized accuracy weighted by test examples, per evaluated round), the lowest
  client's curve, the mean task accuracy's curve (pFedC's figure, where recorded), uplink
  and time.
- A configuration is chosen on validation data only (``choose``): the tuning runs that
  compete are scored on validation splits carved from the clients' training shares
  (``validation-fraction``), never on a test split a reported figure is computed on.
- A run's figure is the mean of its last ``LAST_ROUNDS`` evaluated rounds (never the best
  round: choosing a round on test data flatters every method, the noisy ones most), none of
  them in the first quarter of the run's rounds, so that a short run is read on fewer rounds
  (``figure_rounds``: a run of 5 rounds on rounds 3-5), never on its first ones; its
  slope, in accuracy per round over the last ``SLOPE_ROUNDS`` rounds (least squares), says
  whether the curve has stopped rising.
- A method is the mean and sample standard deviation of its runs' figures over seeds.
- A report seed whose run diverged, or collapsed (``collapsed``: its figure below half its
  best mean over ``LAST_ROUNDS`` consecutive rounds), is unstable (``unstable``): a row with
  one is never called not worse, better or tied.
- A method against a reference is the paired difference per seed (same seed: same data
  split, same initial model), its mean and a 95% confidence interval (Student's t over the
  seeds they share; none for a single seed).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import stats

from common.config import EVALUATED_LAST_ROUNDS

LAST_ROUNDS = 5
SLOPE_ROUNDS = EVALUATED_LAST_ROUNDS  # rounds that every run evaluates, at any evaluate-every
# Curves have converged when the upper end of the 95% interval (over seeds) of their slope
# over the last SLOPE_ROUNDS is at most this, in accuracy a round: one point, a usual margin,
# per 10 rounds (one seed: no interval, not judged)
CONVERGED_SLOPE = 0.001
# A report seed that collapsed: the mean of its last rounds (its figure) below this share of
# its best mean over LAST_ROUNDS consecutive evaluated rounds. With a seed that diverged, an
# unstable seed: the same rule for every row, compare's and the matrix's (``unstable``).
COLLAPSED_SHARE = 0.5
MB = 1024**2
# keys that do not change a run's numbers: a stored run that differs only in these is reused
# (evaluate-every thins the curve, not the figures: those read the rounds it always evaluates,
# except where thins_figures says otherwise)
NOT_IN_RESULTS = frozenset({"output-dir", "resume-from", "plot", "tracking", "device",
                            "data-cache", "round-timeout", "max-in-flight", "evaluate-every"})
PROJECT_CACHE = "/.cache/pflower/"  # under a home folder: the project's data cache


def config_tag(config: Mapping[str, Any]) -> str:
    """A config as part of a file name. No commas: Flower lists a FAB's files as
    ``path,sha256,bits`` lines, so a comma in any file under an app breaks ``flwr run .``."""
    return "+".join(f"{k}={v}" for k, v in sorted(config.items())) or "defaults"


def comparable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a run's numbers depend on: its resolved config (the app's defaults under its run
    config) without the keys that change no number, a data file in the project's cache named
    from the cache on (``~/.cache/pflower/bench/...``: the home folder differs between
    machines; any other path, or a hub name, counts whole). Two runs whose comparable configs
    are equal give the same numbers."""
    return {k: _in_cache(v) if k == "dataset" else v
            for k, v in config.items()
            if k not in NOT_IN_RESULTS or (k == "evaluate-every" and thins_figures(config))}


def thins_figures(config: Mapping[str, Any]) -> bool:
    """Whether ``evaluate-every`` may change a run's figures (docs/results.md): where a DP
    budget stop can end the run before its last rounds, or where a client can go unheard
    long enough to expire (not everyone evaluates, and ids expire)."""
    return bool(config.get("dp.target-epsilon")
                or (config.get("fraction-evaluate", 1.0) < 1
                    and config.get("identity.expire-rounds", 0)))


def _in_cache(dataset: Any) -> Any:
    head, cached, rest = str(dataset).partition(PROJECT_CACHE)
    return f"~{PROJECT_CACHE}{rest}" if cached and head.startswith("/") else dataset


def summarize_run(results: Mapping[str, Any]) -> dict[str, Any]:
    """What a comparison keeps of one run's results.json: final numbers and per-round series
    (accuracies as fractions, bytes in MB); under DP the spent budget (``privacy``); and the
    mean task accuracy (``accuracy_task_mean``, final, and ``accuracy_task_per_round``) when
    every evaluated round has it (results.json written before it was recorded has none)."""
    evaluated = [r for r in results["rounds"] if "eval" in r]
    final = results["final"]
    summary = {
        "accuracy_weighted": final["accuracy_weighted"],
        "accuracy_mean": final["accuracy_mean"],
        "accuracy_min": final["accuracy_min"],
        "evaluated_on": results.get("evaluated_on", "test"),
        "mb_up_total": final["bytes_up_total"] / MB,
        "seconds_total": final["seconds_total"],
        "rounds": [r["round"] for r in evaluated],
        "accuracy_per_round": [r["eval"]["accuracy_weighted"] for r in evaluated],
        "accuracy_min_per_round": [r["eval"]["accuracy_min"] for r in evaluated],
        "mb_up_per_round": [r["bytes_up"] / MB for r in results["rounds"]],
    }
    summary.update(spent_privacy(results))
    if evaluated and all("accuracy_task_mean" in r["eval"] for r in evaluated):
        summary["accuracy_task_per_round"] = [r["eval"]["accuracy_task_mean"] for r in evaluated]
        summary["accuracy_task_mean"] = final.get("accuracy_task_mean",
                                                  summary["accuracy_task_per_round"][-1])
    return summary


def spent_privacy(results: Mapping[str, Any]) -> dict[str, Any]:
    """``{"privacy": ...}``: what a run under DP spent by its end (docs/privacy.md), whether
    it completed or diverged; nothing without DP."""
    final = results.get("final", {})
    return {"privacy": final["privacy"]} if "privacy" in final else {}


def figure_rounds(rounds: Iterable[int]) -> list[int]:
    """Of a run's evaluated rounds (ascending), those its figure is the mean of: the last
    ``LAST_ROUNDS`` (all where there are fewer), none in the first quarter of the run (rounds
    1 to ceil(n/4) of a run of n: a run of 5 rounds is read on rounds 3-5, one of 2 on round
    2, one of 7 or more on its last 5), and its last round where nothing else is left (a run
    of one round)."""
    rounds = list(rounds)
    if rounds:
        early = math.ceil(rounds[-1] / 4)
        rounds = [r for r in rounds if r > early] or rounds[-1:]
    return rounds[-LAST_ROUNDS:]


def full_window_rounds() -> int:
    """The fewest rounds whose run is read on a full window of ``LAST_ROUNDS`` rounds (7)."""
    return next(n for n in itertools.count(1)
                if len(figure_rounds(range(1, n + 1))) == LAST_ROUNDS)


def last_rounds_mean(curve: Sequence[float], *, rounds: Sequence[int] | None = None
                     ) -> float:
    """The mean of a curve's values on its ``figure_rounds`` (``rounds``: the curve's round
    numbers; by default 1, 2, ...)."""
    if not curve:
        raise ValueError("no evaluated round")
    window = figure_rounds(range(1, len(curve) + 1) if rounds is None else rounds)
    return statistics.fmean(curve[-len(window):])


def run_window(summary: Mapping[str, Any]) -> list[int]:
    """The rounds a run's figures are the mean of (``figure_rounds`` of its evaluated
    rounds)."""
    return figure_rounds(summary.get("rounds") or range(1, len(summary["accuracy_per_round"])
                                                        + 1))


def slope(curve: Sequence[float], rounds: int = SLOPE_ROUNDS) -> float:
    """Least-squares change per round over the last ``rounds`` values (0 for one value)."""
    tail = np.asarray(curve[-rounds:], dtype=float)
    if len(tail) < 2:
        return 0.0
    return float(np.polyfit(np.arange(len(tail)), tail, 1)[0])


def slope_interval(slopes: Sequence[float]) -> tuple[float, float] | None:
    """The 95% interval of the mean of per-seed slopes (None for one seed)."""
    return mean_interval(slopes)[1]


def converged(slopes: Sequence[float]) -> bool:
    """Whether curves with these per-seed slopes have stopped rising (``CONVERGED_SLOPE``)."""
    interval = slope_interval(slopes)
    return interval is not None and bool(interval[1] <= CONVERGED_SLOPE)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (0 for a single seed)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def run_figures(summary: Mapping[str, Any]) -> dict[str, float]:
    """One run's figures: the mean over its ``run_window`` of the weighted and of the lowest
    client's accuracy (a summary stored before the lowest client's curve was kept gives its
    final value), its slope, uplink and seconds; and that mean of the task accuracy where
    the run recorded it."""
    curve = summary["accuracy_per_round"]
    rounds = summary.get("rounds") or list(range(1, len(curve) + 1))
    low = summary.get("accuracy_min_per_round")
    task = summary.get("accuracy_task_per_round")

    def mean(values: Sequence[float]) -> float:
        return last_rounds_mean(values, rounds=rounds)

    return {"accuracy": mean(curve),
            "accuracy_min": mean(low) if low else summary["accuracy_min"],
            "slope": slope(curve),
            "mb_up": summary["mb_up_total"], "seconds": summary["seconds_total"],
            **({"task_accuracy": mean(task)} if task else {})}


def selection_figure(summary: Mapping[str, Any]) -> float:
    """What a configuration is chosen by: its tuning run's accuracy on its clients'
    validation splits, the mean of the last rounds. A run scored on its test split is
    refused (ValueError): a choice made on test data flatters the chosen configuration on
    every figure reported from that data."""
    if summary.get("evaluated_on") != "validation":
        raise ValueError("a configuration is chosen on validation accuracy only; this run was "
                         f"scored on its {summary.get('evaluated_on', 'test')} split (run it "
                         "with validation-fraction > 0)")
    return run_figures(summary)["accuracy"]


def not_diverged(tried: Sequence[tuple[Any, Mapping[str, Any]]]
                 ) -> list[tuple[Any, Mapping[str, Any]]]:
    """The ``(configuration, run summary)`` pairs whose run did not diverge: those a search
    can choose from."""
    return [pair for pair in tried if pair[1].get("status") != "diverged"]


def by_seed_finished(cells: Sequence[Mapping[str, Any]]
                     ) -> tuple[dict[int, Mapping[str, Any]], list[int]]:
    """Runs of one configuration over seeds (each with its ``seed``): those that finished, by
    seed (``method_stats``'s input), and the seeds of those that diverged (no accuracy)."""
    finished = {c["seed"]: c for c in cells if c.get("status") != "diverged"}
    return finished, sorted(c["seed"] for c in cells if c.get("status") == "diverged")


def collapsed(cell: Mapping[str, Any]) -> str:
    """Why a finished run collapsed ("" where it did not): its figure (the mean of its last
    rounds) below ``COLLAPSED_SHARE`` of its best mean over ``LAST_ROUNDS`` consecutive
    evaluated rounds, e.g. 79.2 to 36.5."""
    curve = cell["accuracy_per_round"]
    last = last_rounds_mean(curve, rounds=cell.get("rounds"))
    best = max(statistics.fmean(curve[i:i + LAST_ROUNDS])
               for i in range(max(1, len(curve) - LAST_ROUNDS + 1)))
    return (f"collapsed: {100 * last:.1f} over its last rounds against a best of "
            f"{100 * best:.1f}" if last < COLLAPSED_SHARE * best else "")


def unstable(cells: Mapping[int, Mapping[str, Any]]) -> dict[int, str]:
    """The seeds (of ``cells``, seed -> run summary) whose run diverged or collapsed, with
    why."""
    return {seed: "diverged" if c.get("status") == "diverged" else why
            for seed, c in sorted(cells.items())
            if c.get("status") == "diverged" or (why := collapsed(c))}


def stability(runs: Mapping[Any, Mapping[str, Any]],
              per_seed: Mapping[Any, Mapping[str, float]]) -> dict[str, Any]:
    """A row's report runs (seed -> run summary, diverged ones included) against its unstable
    seeds rule: the seeds it diverged on, its ``unstable`` seeds (ints) and why (keyed as
    ``runs``), and its accuracy (``per_seed``: ``method_stats``') without them, mean and
    standard deviation (None where no seed is left)."""
    why = unstable({int(seed): run for seed, run in runs.items()})
    keys = {int(seed): seed for seed in runs}
    stable = [f["accuracy"] for seed, f in per_seed.items() if int(seed) not in why]
    return {"diverged_seeds": [s for s, reason in why.items() if reason == "diverged"],
            "unstable_seeds": list(why),
            "unstable_why": {keys[s]: reason for s, reason in why.items()},
            "accuracy_stable": mean_std(stable) if stable else None}


def choose(tried: Sequence[tuple[Any, Mapping[str, Any]]]) -> Any:
    """Of ``(configuration, tuning run summary)`` pairs, the configuration with the highest
    ``selection_figure`` (the first of equals); a run that diverged (``"status":
    "diverged"``: its losses stopped being finite) is never chosen."""
    finished = not_diverged(tried)
    if not finished:
        raise ValueError("every configuration diverged: widen the search downwards")
    return max(finished, key=lambda pair: selection_figure(pair[1]))[0]


def method_stats(per_seed: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """A method over its seeds (seed -> run summary): each figure's mean and standard
    deviation, and the per-seed figures."""
    figures = {seed: run_figures(summary)
               for seed, summary in sorted(per_seed.items())}
    slopes = [f["slope"] for f in figures.values()]
    return {"seeds": list(figures), "per_seed": figures,
            **{name: mean_std([f[name] for f in figures.values()])
               for name in ("accuracy", "accuracy_min", "slope", "mb_up", "seconds")},
            "slope_ci95": slope_interval(slopes), "converged": converged(slopes)}


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float]
                      ) -> dict[str, Any] | None:
    """``values`` minus ``reference`` on the seeds both have: the per-seed differences, their
    mean and its 95% confidence interval (None for a single seed); None without a common
    seed."""
    seeds = sorted(set(values) & set(reference))
    if not seeds:
        return None
    diffs = [values[s] - reference[s] for s in seeds]
    mean, ci95 = mean_interval(diffs)
    return {"seeds": seeds, "paired_diffs": diffs, "mean_diff": mean, "ci95": ci95}


def judge_difference(difference: Mapping[str, Any] | None, margin: float) -> dict[str, Any]:
    """A paired difference judged against ``margin`` (held when its 95% interval lies at or
    above it: -0.01 is non-inferiority within a point, +0.05 five points better) and against
    0 (superiority: held when the interval lies above 0); where the interval lies against the
    margin. "not measured" without an interval (fewer than two common seeds)."""
    if difference is None or difference["ci95"] is None:
        return {"verdict": "not measured", "superiority": "not measured", "interval": None}
    low, high = difference["ci95"]
    return {"verdict": "held" if low >= margin else "did not hold",
            "superiority": "held" if low > 0 else "did not hold",
            "interval": ("above the margin" if low >= margin else
                         "below the margin" if high < margin else "across the margin")}


def mean_interval(values: Sequence[float]) -> tuple[float, tuple[float, float] | None]:
    """The mean of per-seed values and its 95% Student-t interval (None for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    half = (stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values)
            / math.sqrt(len(values)))
    return mean, (mean - half, mean + half)


def accuracy_difference(method: Mapping[str, Any], reference: Mapping[str, Any],
                        figure: str = "accuracy") -> dict[str, Any] | None:
    """``paired_difference`` of two methods' per-seed ``figure`` (each with ``per_seed`` as
    ``method_stats`` gives it; ``"task_accuracy"`` for the mean over tasks)."""
    return paired_difference({s: f[figure] for s, f in method["per_seed"].items()},
                             {s: f[figure] for s, f in reference["per_seed"].items()})



def seeds_named(seeds: Sequence[int]) -> str:
    """``seed 3``, ``seeds 1, 2``: seeds as a line of a report names them."""
    return f"seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"


def points(difference: Mapping[str, Any]) -> str:
    """A paired difference (``paired_difference``) in accuracy points with its 95% interval,
    ``+6.7 [+5.8, +7.6]``; the mean alone for a single seed."""
    interval = ("" if difference["ci95"] is None else
                f" [{100 * difference['ci95'][0]:+.1f}, {100 * difference['ci95'][1]:+.1f}]")
    return f"{100 * difference['mean_diff']:+.1f}{interval}"
