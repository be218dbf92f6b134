"""``summary.json``: v3's fields, and protocol v4's (its version, each scenario's rounds and
what they were chosen on, each row's local epochs, unstable seeds, figure at the base rounds
and, for Factorized-FL, mu's density; each claim's place in the primary family with its
Holm-adjusted interval; each scenario's pick)."""

from __future__ import annotations

from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.claims import PRIMARY
from bench.evidence.pick import MARGIN
from bench.evidence.protocol import POOL_SIZE, SCENARIOS
from bench.evidence.rounds import ROUNDS_CHOSEN_ON, validation_slope
from bench.evidence.stats import flag, slope_ci95, uplink_per_round
from comparison.multiplicity import ALPHA
from comparison.stats import COLLAPSED_SHARE, CONVERGED_SLOPE, last_rounds_mean


def searched_rates(row: dict[str, Any]) -> list[float]:
    """The learning rates a row's search tried, its steps past the grid included."""
    return sorted({c["lr"] for c in row["grid"]})


def lr_at_grid_end(row: dict[str, Any]) -> bool:
    """Whether a tuned row's chosen learning rate is the smallest or largest it searched
    (after its steps past the grid: ``protocol.next_learning_rate``)."""
    rates = searched_rates(row)
    return row["tuned"] and row["chosen"]["lr"] in (rates[0], rates[-1])


def thinned(cell: dict[str, Any]) -> dict[str, list[int]]:
    """``{"rounds": ...}``, the rounds a cell's curve is of, where that is not every round
    (``evaluate-every``); else nothing."""
    rounds = cell["rounds"]
    return {} if rounds == list(range(1, len(rounds) + 1)) else {"rounds": rounds}


def scenario_rounds(matrix: Matrix, scenario: str) -> dict[str, Any]:
    """A scenario's rounds R, its base rounds and the validation slopes R was read from, by
    length and row (null: that tuning run diverged)."""
    return {"rounds": matrix.rounds(scenario), "base_rounds": matrix.base_rounds(scenario),
            "rounds_chosen_on": ROUNDS_CHOSEN_ON, "tuning_seed": SCENARIOS[scenario].tuning_seed,
            "validation_slopes": {str(length): {label: validation_slope(c)
                                                for label, c in cells.items()}
                                  for length, cells in matrix.length_cells(scenario).items()}}


def row_summary(matrix: Matrix, scenario: str, r: dict[str, Any]) -> dict[str, Any]:
    config = SCENARIOS[scenario].config
    base = r.get("at_base")
    return {
        "method": r["method"], "num_clients": matrix.clients(scenario),
        "fraction_train": config.get("fraction-train", 1.0),
        "rounds": r["num_rounds"], "local_epochs": r["local_epochs"],
        "lr_grid": searched_rates(r), "grid": r["grid"], "lr_at_grid_end": lr_at_grid_end(r),
        "diverged": r["diverged"], "diverged_seeds": r["diverged_seeds"],
        "unstable_seeds": r["unstable_seeds"],
        "unstable_why": {str(s): why for s, why in r["unstable_why"].items()},
        "chosen": r["chosen"], "tuned": r["tuned"],
        "searched_on": SCENARIOS[scenario].searched_on or scenario,
        "per_seed": {str(c["seed"]): {"last5": r["per_seed"][c["seed"]]["accuracy"],
                                      "curve": c["accuracy_per_round"], **thinned(c),
                                      **({"task_last5": last_rounds_mean(
                                          c["accuracy_task_per_round"])}
                                         if "accuracy_task_per_round" in c else {})}
                     for c in r["cells"]},
        "mean": r["accuracy"][0], "std": r["accuracy"][1],
        "mean_stable": r["accuracy_stable"][0] if r["accuracy_stable"] else None,
        "slope_last10": r["slope"][0],
        "slope_ci95": list(slope_ci95(r) or ()), "converged": not flag(r), "flag": flag(r),
        "mb_up": r["mb_up"][0], "mb_up_per_round": uplink_per_round(r),
        "validation": r["validation"],
        **({"at_base_rounds": {"rounds": base["rounds"], "mean": base["accuracy"][0],
                               "std": base["accuracy"][1], "mb_up": base["mb_up"][0],
                               "per_seed": {str(s): f["accuracy"]
                                            for s, f in base["per_seed"].items()}}}
           if base else {}),
        **({"task_mean": r["accuracy_task"][0]} if "accuracy_task" in r else {}),
        **({"mu_density": r["mu_density"]} if "mu_density" in r else {}),
        **({"mu_density_missing": r["mu_density_missing"]}
           if "mu_density_missing" in r else {})}


def pick_summary(pick: dict[str, Any]) -> dict[str, Any]:
    return {"run": pick["run"], "also": list(pick["also"]), "avoid": list(pick["avoid"]),
            "avoid_why": pick["avoid"], "undecided": list(pick["undecided"]),
            "missing": pick["missing"], "provisional": pick["provisional"]}


def summary(matrix: Matrix, stats: dict[str, dict[str, dict[str, Any]]],
            judged: list[dict[str, Any]], picked: dict[str, dict[str, Any]]
            ) -> dict[str, Any]:
    """``summary.json``: the protocol, every row's search and seeds, every claim's judgement
    (accuracies as fractions), every scenario's pick."""
    rows = {f"{scenario}/{label}": row_summary(matrix, scenario, r)
            for scenario, entries in stats.items() for label, r in entries.items()}
    return {"protocol": {"version": protocol.PROTOCOL_VERSION,
                         "rounds": {s: scenario_rounds(matrix, s) for s in SCENARIOS},
                         "rounds_chosen_on": ROUNDS_CHOSEN_ON,
                         "local_epochs": matrix.common.get("local-epochs"),
                         "tuning_seed": protocol.TUNING_SEED,
                         "report_seeds": list(protocol.REPORT_SEEDS),
                         "extra_seeds": [],
                         "seeds_rule": "every claim on all report seeds from the start",
                         "exploratory_seeds": list(protocol.exploratory_seeds()),
                         "primary_claims": sorted(PRIMARY), "holm_alpha_one_sided": ALPHA,
                         "collapsed_share": COLLAPSED_SHARE, "pick_margin": MARGIN,
                         "selection": "validation",
                         "validation_fraction": protocol.TUNING["validation-fraction"],
                         "tuning_pool": {"dataset": "fashion-mnist", "size": POOL_SIZE,
                                         "disjoint_from_report_pool": True},
                         "converged_slope": CONVERGED_SLOPE,
                         "max_doublings": protocol.MAX_DOUBLINGS,
                         "lr_grid": list(protocol.LR_GRID),
                         "lr_steps_past_the_grid": {"below": list(protocol.LR_BELOW),
                                                    "above": list(protocol.LR_ABOVE),
                                                    "at_most": protocol.MAX_LR_STEPS},
                         "extra_configs": protocol.EXTRA_CONFIGS,
                         "common_knobs": protocol.COMMON_KNOBS,
                         "settings": protocol.SETTINGS,
                         "common": {k: v for k, v in matrix.common.items() if k != "dataset"},
                         "pool": {"dataset": "fashion-mnist", "size": POOL_SIZE},
                         "scenarios": {s: {"config": sc.config, "num_clients": sc.num_clients}
                                       for s, sc in SCENARIOS.items()}},
            "rows": rows, "claims": judged,
            "pick": {s: pick_summary(p) for s, p in picked.items()},
            "what_to_pick": {s: {"best": p["run"], "tied": list(p["also"]),
                                 "missing": p["missing"], "provisional": p["provisional"],
                                 "diverged": [label for label, why in p["avoid"].items()
                                              if not why.startswith("below")]}
                             for s, p in picked.items()}}
