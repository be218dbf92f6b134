"""What makes a paper method itself (protocol v4): every configuration its row searches keeps
it, so that a verdict on the row is a verdict on the paper's mechanism; turning it off is an
ablation (``protocol.ABLATIONS``), never a searched configuration.

- Factorized-FL: a sparse personal bias ``mu`` (the L1 penalty on it above 0), factors
  matched across clients (``tau`` below 1: with 1 a client averages only with itself) and
  ``v`` and ``mu`` personal (not the ``uvm`` variant, which shares them).
- FedDecomp: a low-rank personal part ``B A`` (no rank ratio of 1.0, full rank) trained for
  some of the local epochs and not all of them (``sigma`` trains in the others).
- FedFac: a split of the analysed layers estimated by factor analysis (its threshold quantile
  strictly between 0 and 1, so that some elements are shared and some personal; not the
  random split, the reference of its split claim).
- pFedC: its classifier branches, averaged over their holders (eq. 7): more than one task.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def _factorized_fl(c: Mapping[str, Any]) -> list[str]:
    return ([f"factorized-fl.l1 = {c['factorized-fl.l1']}: mu is not sparse"]
            * (not c["factorized-fl.l1"] > 0)
            + [f"factorized-fl.tau = {c['factorized-fl.tau']}: each client averages with itself"]
            * (c["factorized-fl.tau"] >= 1)
            + ["factorized-fl.variant = uvm: v and mu shared"]
            * (c["factorized-fl.variant"] == "uvm"))


def _full_rank(rank: Any) -> bool:
    """A rank given as a ratio of 1.0 (an integer is a rank: 4 is a rank of 4)."""
    return isinstance(rank, float) and rank >= 1.0


def _feddecomp(c: Mapping[str, Any]) -> list[str]:
    lora = c["feddecomp.lora-epochs"]
    return ([f"feddecomp.{k} = {c[f'feddecomp.{k}']}: the personal part is full rank"
             for k in ("rank-conv", "rank-linear") if _full_rank(c[f"feddecomp.{k}"])]
            + [f"feddecomp.lora-epochs = {lora} of {c['local-epochs']}: one part never trains"]
            * (not 0 < lora < c["local-epochs"]))


def _fedfac(c: Mapping[str, Any]) -> list[str]:
    quantile = c["fedfac.tau-quantile"]
    return ([f"fedfac.tau-quantile = {quantile}: no split (all shared or all personal)"]
            * (not 0 < quantile < 1)
            + [f"fedfac.split = {c['fedfac.split']}: not the estimated split"]
            * (c["fedfac.split"] != "estimate"))


def _pfedc(c: Mapping[str, Any]) -> list[str]:
    return ([f"pfedc.tasks = {c['pfedc.tasks']}: one branch"] * (c["pfedc.tasks"] == 1)
            + [f"pfedc.branches = {c['pfedc.branches']}: eq. 7's averaging off"]
            * (c["pfedc.branches"] != "averaged"))


MECHANISMS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "factorized-fl": _factorized_fl, "feddecomp": _feddecomp, "fedfac": _fedfac,
    "pfedc": _pfedc}


def mechanism_off(method: str, resolved: Mapping[str, Any]) -> list[str]:
    """Why a run of ``method`` with the resolved config ``resolved`` (the app's defaults under
    its run config) is not the paper's mechanism; empty where it is (or ``method`` is a
    baseline)."""
    rule = MECHANISMS.get(method)
    return rule(resolved) if rule else []


# Factorized-FL's mu density at the end of a run, the share of mu's elements that are not
# zero: what its sparsity claim is about. A cell carries it as MU_DENSITY, read from the run's
# results.json as it is stored (``recorded_mu_density``).
MU_DENSITY = "mu_density"
# The app records it: Factorized-FL's client replies with the train metric "mu-density" (the
# share of its mu's elements above models.factorized_fl.MU_ZERO after local training) and its
# rule reports the example-weighted mean of the round's as the round's "mu_density". A cell
# from before that (v3's) has none: its row's ``mu_density`` is null and
# ``mu_density_missing`` says why.
MU_DENSITY_MISSING = "not recorded: its cells ran before the app reported mu's density"


def recorded_mu_density(results: Mapping[str, Any]) -> float | None:
    """mu's density at the end of a run, from its results.json: its ``final`` figure, else
    its last round's; None where the run recorded none."""
    if (final := results.get("final", {}).get(MU_DENSITY)) is not None:
        return float(final)
    recorded = [r[MU_DENSITY] for r in results.get("rounds", []) if MU_DENSITY in r]
    return float(recorded[-1]) if recorded else None
