"""The matrix's protocol: the data, the common settings, the scenarios and their rows, the
search (one learning-rate grid for every row, then further configurations up to the same
number for every row), the rounds, the seeds, the ablations, and where a cell is stored.

Selection never sees a reported image: a tuning run reads the tuning pool, 5,000 images
disjoint from the report pool's, and is scored on validation splits carved from its
clients' training shares (``TUNING``); a report run reads the report pool and is scored on
its test splits. Protocol v4 (``PROTOCOL_VERSION``; bench/README.md) adds equal rounds and
local epochs within a scenario, ten seeds from the start, and each paper method's mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.data import ensure_dataset
from comparison.stats import config_tag
from fldata.sources import idx_pool

POOL_SIZE = 5000       # images drawn from the 60,000: 250 a client, 125 to train and 125 to test
REPORT_POOL_SEED, TUNING_POOL_SEED = 0, 1   # the tuning pool is drawn from the other 55,000
NUM_CLIENTS = 20
PROTOCOL_VERSION = 4
TUNING_SEED = 0
# Ten report seeds from the start, for every row: no decision about seeds reads a report seed,
# each claim is judged once (v3's second look raised a false "held" from 2.5% to 4.3%). The first
# ten from 1 every scenario can partition (3, 9-12 cannot give cross-device's 100 clients 10
# images: tests/test_matrix_v4.py). Exploratory cells run on the first EXPLORATORY_SEEDS.
REPORT_SEEDS = (1, 2, 4, 5, 6, 7, 8, 13, 14, 15)
EXPLORATORY_SEEDS = 5
ROUNDS = 40            # a scenario's base rounds, unless it sets its own
# A scenario's rounds R (bench/evidence/rounds.py): the smallest of its base rounds and their
# doublings (at most MAX_DOUBLINGS) at which every row's tuning run at its chosen configuration
# has converged on validation; every row then runs R rounds on every report seed.
MAX_DOUBLINGS = 2
# LeNet-5 (the pFedC paper's MNIST model, with BatchNorm): a third of the CNN's cost on 2
# cores. Half of each client's share is its test split: 125 training images keep Local off the
# ceiling 200 gave it (89-98%), and 2,500 test images a scenario halve the noise of 1,000.
COMMON: dict[str, Any] = {"model": "lenet5", "num-server-rounds": ROUNDS, "local-epochs": 5,
                          "batch-size": 32, "momentum": 0.9, "test-fraction": 0.5,
                          "plot": False}
BASELINES = ("fedavg", "fedprox", "local", "fedper", "fedrep", "fedbn", "fedavg-ft")
# Rows beside the baselines, not among a claim's "best baseline" (the claims predate them)
OTHER_ROWS = ("ditto", "fedala")
# A tuning run sees a client share of a report run's size, half of it trained on, half its
# validation split (in place of the test split, which a validation run never evaluates: one
# example is kept back for it), from the tuning pool.
TUNING: dict[str, Any] = {"test-fraction": 0.01, "validation-fraction": 0.5}
# Log-spaced over two and a half decades, for every row, baseline or paper method: wide
# enough that a row's choice should lie inside it (what follows handles one that does not).
LR_GRID = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)
EXTRA_CONFIGS = 4   # every row's further configurations, at its best learning rate
# Where a row's best rate is nevertheless an end of the rates it tried, its search goes one
# step of the grid's spacing further past that end, and again while its best is the new end,
# at most MAX_LR_STEPS times, each in place of one of its EXTRA_CONFIGS (its last ones), so
# that every row still tries len(LR_GRID) + EXTRA_CONFIGS configurations.
LR_BELOW = (0.0003, 0.0001)
LR_ABOVE = (1.0, 3.0)
MAX_LR_STEPS = 2
assert min(len(LR_BELOW), len(LR_ABOVE), EXTRA_CONFIGS) >= MAX_LR_STEPS  # a step per slot
# What a row without (enough) settings of its own searches instead: knobs that change what one
# SGD step does, never how many a round takes (v4: every row computes as much a round; v3's 2 and
# 10 local epochs did not). Momentum 0.5 for 0.9: an effective step of 2 lr, not 10 lr, less drift
# a round, what v3's 2 local epochs offered. Not the batch size: a smaller one takes more steps.
COMMON_KNOBS: list[dict[str, Any]] = [{"weight-decay": 1e-4}, {"weight-decay": 1e-3},
                                      {"momentum": 0.5}, {"weight-decay": 1e-2}]

# Each method's most influential settings over the range its paper reports, searched at the
# row's best learning rate (its defaults, the papers' values, ran with the grid above);
# ``COMMON_KNOBS`` fill each row's further configurations up to ``EXTRA_CONFIGS``. A paper
# method keeps its mechanism in every one (bench/evidence/mechanism.py): turning it off is an
# ablation (``ABLATIONS``), never a searched configuration.
SETTINGS: dict[str, list[dict[str, Any]]] = {
    "fedprox": [{"fedprox.mu": mu} for mu in (0.001, 0.1, 0.5, 1.0)],
    "fedrep": [{"fedrep.head-epochs": e} for e in (2, 3, 4)],
    # the default scale is the authors' (models/feddecomp.py); the paper's ablations vary the
    # conv rank ratio and the epochs on tau
    "feddecomp": [{"feddecomp.tau-scale": "inverse-rank"}, {"feddecomp.tau-scale": "none"},
                  {"feddecomp.rank-conv": 0.3}, {"feddecomp.lora-epochs": 1}],
    # every one a split of the analysed layers (v3's tau-quantile 2.0, the analysed layer wholly
    # personal, the authors' CIFAR setting, estimates no split: an ablation now)
    "fedfac": [{"fedfac.tau-quantile": 0.75}, {"fedfac.layers": "-3,-2"},
               {"fedfac.tau-quantile": 0.5}, {"fedfac.tau-quantile": 0.95}],
    # Ditto's lambda and the personal model's share of the 5 epochs; FedALA's mixed tensors
    # and the share of the data its weights are learned on
    "ditto": [{"ditto.lambda": 0.01}, {"ditto.lambda": 1.0}, {"ditto.personal-epochs": 2},
              {"ditto.lambda": 0.001}],
    "fedala": [{"fedala.layers": n} for n in (4, 6)] + [{"fedala.data-fraction": f}
                                                         for f in (0.5, 0.2)],
    "pfedc": [{"pfedc.mgda": False}, {"pfedc.weighting": "counts"}, {"pfedc.tasks": 5},
              {"pfedc.mgda": False, "pfedc.weighting": "counts"}],
    # the row starts mu at zeros, as the paper says (FACTORIZED_FL); the authors' code's Xavier
    # start is a setting; L1 on mu above 0 in every one (the default 0.0005, a decade either
    # side): mu is the paper's sparse personal bias (v3 searched l1 = 0, a dense personal
    # weight, and chose it on three scenarios: an ablation now)
    "factorized-fl": [{"factorized-fl.mu-init": "xavier"},
                      {"factorized-fl.tau": 0.95, "factorized-fl.epsilon": 20.0,
                       "factorized-fl.min-aggregated": 4},
                      {"factorized-fl.l1": 0.005}, {"factorized-fl.l1": 0.00005}],
}


@dataclass(frozen=True)
class Entry:
    """One row of a scenario: a method, with fixed overrides that make it a variant."""

    label: str
    method: str
    fixed: dict[str, Any] = field(default_factory=dict)


def entry(label: str, **fixed: Any) -> Entry:
    return Entry(label, label.split("@", 1)[0], {k.replace("__", "."): v
                                                 for k, v in fixed.items()})


@dataclass(frozen=True)
class Scenario:
    """A data regime: its run-config overrides, its number of clients and its rows.
    ``searched_on``: its rows report the configuration the same row chose on that scenario
    instead of searching again (the same for every row; where runs cost most).
    ``tuning_seed``: its tuning runs' (search and rounds)."""

    config: dict[str, Any]
    entries: list[Entry]
    num_clients: int = NUM_CLIENTS
    question: str = ""
    searched_on: str | None = None
    tuning_seed: int = TUNING_SEED


FEDFAC_STATIC = entry("fedfac")
FEDFAC_DYNAMIC = entry("fedfac@dynamic", fedfac__mode="dynamic")
# FedDecomp's paper trains B A for 2 of its 5 local epochs (the app's default, 1, is for its
# default of 2 local epochs)
FEDDECOMP = Entry("feddecomp", "feddecomp", {"feddecomp.lora-epochs": 2})
# Factorized-FL's mu starts at zeros, as its paper says (the layer starts as u v^T); the app's
# default, Xavier, is its authors' code's start, searched as a setting
FACTORIZED_FL = Entry("factorized-fl", "factorized-fl", {"factorized-fl.mu-init": "zeros"})
PAPER_METHODS = [FEDDECOMP, FEDFAC_STATIC, FEDFAC_DYNAMIC, entry("pfedc"), FACTORIZED_FL]

# Each paper's method on its paper's scenario, all of them on the shared Dirichlet 0.1 and on
# cross-device, baselines everywhere.
SCENARIOS: dict[str, Scenario] = {
    "dirichlet-0.1": Scenario(
        {"partitioner": "dirichlet", "dirichlet-alpha": 0.1},
        [*map(entry, (*BASELINES, *OTHER_ROWS)), *PAPER_METHODS],
        question="label skew, 20 clients of 250 images (FedDecomp's, FedFac's setting)"),
    "pathological-2": Scenario(
        {"partitioner": "pathological", "classes-per-client": 2},
        [*map(entry, (*BASELINES, *OTHER_ROWS)), entry("pfedc")],
        question="two classes a client (pFedC's setting)"),
    "permuted-labels": Scenario(
        {"partitioner": "iid", "permute-labels": True},
        [*map(entry, (*BASELINES, *OTHER_ROWS)), FACTORIZED_FL],
        question="each client its own label permutation (Factorized-FL's setting)"),
    "feature-shift": Scenario(
        {"partitioner": "iid", "feature-shift": "rotate", "feature-shift-groups": 4},
        [*map(entry, (*BASELINES, *OTHER_ROWS)), FACTORIZED_FL],
        question="four client groups whose images are rotated by 0, 90, 180, 270 degrees, "
                 "labels IID (multi-domain, as Factorized-FL's and FedBN's)"),
    "feature-shift-skew": Scenario(
        {"partitioner": "dirichlet", "dirichlet-alpha": 0.5, "feature-shift": "rotate",
         "feature-shift-groups": 4},
        [*map(entry, (*BASELINES, *OTHER_ROWS)), FACTORIZED_FL],
        question="the same rotated groups with label skew (Dirichlet 0.5)",
        searched_on="feature-shift"),
    "cross-device": Scenario(
        # evaluate-every: 90 of a round's 100 messages are evaluations; every 10th round and
        # the last 10 give the same figures (docs/results.md), in a fraction of the time
        {"partitioner": "dirichlet", "dirichlet-alpha": 0.3, "fraction-train": 0.1,
         "num-server-rounds": 160, "evaluate-every": 10},
        [*map(entry, (*BASELINES, *OTHER_ROWS)), *PAPER_METHODS], num_clients=100,
        # seed 0 draws no partition of the tuning pool giving 100 clients 10 images each at
        # Dirichlet 0.3; 16, the first past the report seeds (their initial models), does
        searched_on="dirichlet-0.1", tuning_seed=16,
        question="100 clients of 10 to 145 images (median 44; Dirichlet 0.3, as 0.1 cannot "
                 "give each of 100 clients 10 of the 5,000), 10 a round, 160 rounds (FedFac's "
                 "setting; a client takes part about 16 times, and at 80 rounds Local, FedBN "
                 "and FedDecomp were still rising)"),
}


@dataclass(frozen=True)
class Ablation:
    """A row's tuned configuration with one change, on the report seeds (``--ablations``): a
    claim that did not hold, probed, or the reference a claim is judged against."""

    scenario: str
    label: str               # the row it varies
    change: dict[str, Any]   # replaces or adds keys of that row's tuned configuration
    question: str


SAME_SIZE_RANDOM_SPLIT = {"fedfac.split": "random"}


def pfedc_without_mgda(scenario: str) -> Ablation:
    return Ablation(scenario, "pfedc", {"pfedc.mgda": False},
                    "Equal task weights instead of MGDA-UB's, all else the row's.")


def factorized_fl_all_shared(scenario: str) -> Ablation:
    return Ablation(scenario, "factorized-fl", {"factorized-fl.variant": "uvm"},
                    "u, v and mu of every layer shared (Factorized-FL beta), all else the "
                    "row's: what keeping v and mu personal costs.")


ABLATIONS = [
    # The reference FedFac's split claim needs: the row's own tuned configuration (so the
    # same layers and threshold, hence as many shared elements as estimated), the elements
    # drawn at random.
    *(Ablation("dirichlet-0.1", label, SAME_SIZE_RANDOM_SPLIT,
               "A random split of the same size: as many shared elements as estimated, "
               "chosen at random, all else the row's.")
      for label in ("fedfac", "fedfac@dynamic")),
    # pFedC is about a point below the personalized baselines on pathological 2 in every
    # report seed: which of its two parts costs it, eq. 7's averaging or MGDA-UB?
    Ablation("pathological-2", "pfedc", {"pfedc.branches": "personal"},
             "Class branches kept personal (eq. 7's averaging off), all else the row's: what "
             "the averaging is worth."),
    pfedc_without_mgda("pathological-2"),
    # v3: Factorized-FL below the baselines that share the whole body (8 points below FedPer
    # on permuted labels): is it what stays personal (v, mu), or the factorized layers?
    *(ablation
      for scenario in ("permuted-labels", "feature-shift", "feature-shift-skew")
      for ablation in (
          factorized_fl_all_shared(scenario),
          Ablation(scenario, "factorized-fl",
                   {"factorized-fl.variant": "uvm", "factorized-fl.tau": 0.0,
                    "factorized-fl.epsilon": 1.0, "factorized-fl.min-aggregated": 1},
                   "The whole body shared and averaged over all clients with the default, "
                   "near-equal weights, as FedPer does: what the factorized layers cost."))),
    # FedDecomp is 8 points below FedPer on cross-device, where clients hold 10 to 145
    # images: its paper's 1/N mean of sigma assumes clients of equal size.
    Ablation("cross-device", "feddecomp", {"feddecomp.weighting": "examples"},
             "sigma averaged with FedAvg's example weights instead of the paper's 1/N, all "
             "else the row's: what equal weights cost when client sizes differ 15-fold."),
    # FedPer keeps the whole classifier personal; FedDecomp's personal part is B A of half
    # the rank in every layer, and a client trains it about 8 times in 80 rounds.
    Ablation("cross-device", "feddecomp", {"feddecomp.rank": 1.0},
             "A full-rank personal B A in every layer, all else the row's: is the low-rank "
             "personal part too small for clients this different?"),
    Ablation("cross-device", "feddecomp", {"feddecomp.lora-epochs": 4},
             "4 of the 5 local epochs on the personal B A instead of the paper's 2 (so 1 on "
             "sigma instead of 3), all else the row's: is the personal part trained too "
             "little in a client's few visits?"),
    Ablation("cross-device", "feddecomp", {"feddecomp.tau-scale": "none"},
             "tau = B A instead of the authors' B A / r, all else the row's: does the LoRA "
             "scale keep the personal part too small to move in a client's few visits?"),
    # pFedC is 6 points below FedPer on cross-device; MGDA-UB was the part that cost it on
    # pathological 2, and a client of a few dozen images gives it noisy task gradients.
    pfedc_without_mgda("cross-device"),
    # Factorized-FL keeps v and mu personal; a client trains about 8 times in 80 rounds.
    factorized_fl_all_shared("cross-device"),
    # Each paper method's mechanism turned off: an ablation, never a searched configuration.
    # Factorized-FL without L1 on mu, what v3's row chose on three scenarios (0.2-0.4 points).
    *(Ablation(scenario, "factorized-fl", {"factorized-fl.l1": 0.0},
               "No L1 penalty on mu (a dense personal weight instead of the paper's sparse "
               "bias), all else the row's: what the sparsity costs or gains.")
      for scenario in ("permuted-labels", "feature-shift")),
    # FedFac's analysed layer wholly personal (its authors' CIFAR setting): no split
    Ablation("dirichlet-0.1", "fedfac@dynamic", {"fedfac.tau-quantile": 2.0},
             "The analysed layer wholly personal (no element shared, no split estimated), all "
             "else the row's: what the estimated split is worth over a personal layer."),
]


def exploratory_seeds() -> tuple[int, ...]:
    """The report seeds the exploratory cells run on: the first ``EXPLORATORY_SEEDS``."""
    return REPORT_SEEDS[:EXPLORATORY_SEEDS]


def ablation_seeds(ablation: Ablation) -> tuple[int, ...]:
    """Every report seed for the reference of a claim (FedFac's random split of the same
    size), the exploratory seeds for the others (they explain, they judge nothing)."""
    return REPORT_SEEDS if ablation.change == SAME_SIZE_RANDOM_SPLIT else exploratory_seeds()


# Client-level differential privacy (docs/privacy.md), after the ablations: each row below at
# its tuned configuration and its scenario's base rounds (so that every row spends the same
# epsilon at a noise level, whatever R), on the exploratory seeds, against the same seeds'
# report cells read at the base rounds (rounds.prefix), under local DP, the one mode every
# paper method runs under (pFedC's, Factorized-FL's and FedFac's servers read each upload).
# PRIVACY_CLIP_NORM: the median L2 norm of the 20 clients' first-round updates (FedAvg,
# lr 0.01, LeNet-5) on the tuning pool was 1.30 (0.22 to 2.24), rounded down: Andrew et al.
# clip at the median. The noise multipliers span a decade each (at 0.01 the noise's norm over
# 62,000 parameters, averaged over 20 clients, is about half the clip norm; at 1.0 about 50
# times it), written down before any privacy cell ran and kept after FedAvg diverged at 1.0.
PRIVACY_SCENARIOS = ("dirichlet-0.1", "cross-device")
PRIVACY_LABELS = ("fedavg", "fedper", "feddecomp", "fedfac", "factorized-fl", "pfedc")
PRIVACY_REFERENCES = ("fedavg", "fedper")
PRIVACY_CLIP_NORM = 1.0
NOISE_MULTIPLIERS = (0.01, 0.1, 1.0)


def privacy_change(noise_multiplier: float) -> dict[str, Any]:
    """What a privacy cell adds to its row's tuned configuration."""
    return {"dp.mode": "local", "dp.clip-norm": PRIVACY_CLIP_NORM,
            "dp.noise-multiplier": noise_multiplier}


PRIVACY = [Ablation(scenario, label, privacy_change(z), f"local DP, noise multiplier {z}")
           for scenario in PRIVACY_SCENARIOS for label in PRIVACY_LABELS
           for z in NOISE_MULTIPLIERS]


def with_change(config: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """A row's configuration with an ablation's change: every key the change sets replaces
    the row's, a key it sets through a shorthand too (``feddecomp.rank`` replaces a tuned
    ``feddecomp.rank-conv``, which ``expand`` would otherwise keep)."""
    shadowed = set(expand(change)) - set(change)
    return {**{k: v for k, v in config.items() if k not in shadowed}, **change}


def expand(config: dict[str, Any]) -> dict[str, Any]:
    """Run-config overrides of a tuning configuration (``feddecomp.rank`` sets both ranks)."""
    out = {k: v for k, v in config.items() if k != "feddecomp.rank"}
    if "feddecomp.rank" in config:  # a rank key given as well wins
        rank = config["feddecomp.rank"]
        out = {"feddecomp.rank-conv": rank, "feddecomp.rank-linear": rank, **out}
    return out


def learning_rate_stage() -> list[dict[str, Any]]:
    """The search's first stage, the same for every row: its defaults at each learning rate."""
    return [{"lr": lr} for lr in LR_GRID]


def next_learning_rate(best: float | None, tried: list[float]) -> float | None:
    """The rate a row's search tries next, given its best so far and the rates it tried: one
    step past the end of them its best is at (``LR_BELOW``, ``LR_ABOVE``; below where ``best``
    is None, every one diverged); None when its best lies inside them or it took
    ``MAX_LR_STEPS`` steps."""
    below = [lr for lr in tried if lr < LR_GRID[0]]
    above = [lr for lr in tried if lr > LR_GRID[-1]]
    if len(below) + len(above) >= MAX_LR_STEPS:
        return None
    # (a tie goes to the first tried, the grid's smaller rate: a flat row at chance level may
    # spend a step below; harmless, it still tries as many)
    if best is None or best == min(tried):  # None: every rate tried diverged
        return LR_BELOW[len(below)]
    if best == max(tried):
        return LR_ABOVE[len(above)]
    return None


def settings_stage(method: str, lr: float, count: int = EXTRA_CONFIGS) -> list[dict[str, Any]]:
    """The second stage, ``count`` configurations at the row's best learning rate (all
    ``EXTRA_CONFIGS`` unless its rate took steps past the grid): the method's own settings
    (``SETTINGS``), then the common knobs (``COMMON_KNOBS``)."""
    changes = [*SETTINGS.get(method, []), *COMMON_KNOBS][:count]
    return [{"lr": lr, **change} for change in changes]


def results_folder(results: Path) -> Path:
    """Where this protocol's cells, report and summary go under ``bench/results``: apart from
    v3's (``results/report.md``, ``results/matrix/``), which stay the published evidence until
    v4 is complete."""
    return results / f"matrix-v{PROTOCOL_VERSION}"


def cells_folder(device: str = "auto") -> str:
    """Where a device's cells are kept: ``cells`` on the CPU, ``cells-cuda`` and so on apart
    (a GPU's numbers differ from the CPU's in the last bits, and its cells must not replace
    them)."""
    return "cells" if device in ("auto", "cpu") else f"cells-{device.replace(':', '')}"


def cell_path(out: Path, scenario: str, label: str, stage: str, config: dict[str, Any],
              seed: int, device: str = "auto") -> Path:
    return (out / "matrix" / cells_folder(device) / scenario / label.replace("@", "-")
            / f"{stage}-{config_tag(config)}-seed{seed}.json")


def pool_file(size: int = POOL_SIZE, role: str = "report") -> Path:
    """The subsample of Fashion-MNIST's training images the report cells read (``role``
    "report"), or the one the tuning cells read ("tuning"), drawn from the images the report
    pool does not hold; each written once."""
    if role not in ("report", "tuning"):
        raise ValueError(f"role: {role!r}; a pool is the report or the tuning pool")
    name = f"fashion-mnist-{size}.npz" if role == "report" else f"fashion-mnist-{size}-{role}.npz"
    path = Path("~/.cache/pflower/bench").expanduser() / name
    if not path.exists():
        found = ensure_dataset("fashion-mnist")
        if found is None:
            raise SystemExit(1)
        x, y = idx_pool(found)
        report = np.random.default_rng(REPORT_POOL_SEED).choice(len(y), size, replace=False)
        rest = np.setdiff1d(np.arange(len(y)), report)
        chosen = (report if role == "report" else
                  np.random.default_rng(TUNING_POOL_SEED).choice(rest, size, replace=False))
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path.with_suffix(".tmp.npz"), x=x[chosen], y=y[chosen])
        path.with_suffix(".tmp.npz").replace(path)
    return path
