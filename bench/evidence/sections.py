"""The evidence matrix report's sections after its header, in the order they are written
(``SECTIONS``), each from what was judged on the cells present (``Evidence``); a section with
nothing to say writes nothing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.evidence import protocol
from bench.evidence.cells import Matrix
from bench.evidence.claims import claim_line, claims
from bench.evidence.pick import README_LINE_CHARS, pick_lines, picks, readme_lines
from bench.evidence.privacy import privacy_stats, privacy_tables
from bench.evidence.protocol import SCENARIOS
from bench.evidence.stats import ablation_stats, flag, row_stats
from bench.evidence.summary import lr_at_grid_end, searched_rates
from bench.evidence.tables import ablation_table, table

# Where a method here differs from its paper in a way that could move one of its verdicts;
# each page's "Deviations" section has the whole list.
DEVIATIONS = [
    ("FedDecomp", "feddecomp", "a conv's factors have this project's shape (its rank counted "
     "on min(I, O) * K), not the authors' int(ratio * O) * K rows; their scale is followed"),
    ("FedDecomp", "feddecomp", "sigma is averaged over the clients that replied, not over all "
     "clients as the authors' code does (cross-device only)"),
    ("Factorized-FL", "factorized-fl", "mu starts at zeros as the paper says; the authors' "
     "code's Xavier start is searched"),
    ("Factorized-FL", "factorized-fl", "absent clients count through their latest upload; "
     "the paper averages over the round's clients (cross-device only)"),
    ("pFedC", "pfedc", "eq. 7 counts absent holders through their latest branches "
     "(cross-device only)"),
    ("pFedC", "pfedc", "a branch's loss is averaged over the batch, eq. 3 divides it by its "
     "number of classes (matters where MGDA-UB is off)"),
    ("FedFac", "fedfac", "its static mode is a row of its own beside the dynamic one the "
     "paper's later version recommends; the random split is of the estimate's size"),
]


def deviations() -> str:
    return "\n".join(f"- {name}: {text} ([details](../../docs/methods/{page}.md))"
                      for name, page, text in DEVIATIONS)




@dataclass(frozen=True)
class Evidence:
    """What the report is written from: the cells present, judged."""

    matrix: Matrix
    # scenario -> label -> ``row_stats``, for every row with a report seed that finished
    stats: dict[str, dict[str, dict[str, Any]]]
    # the other rows by (scenario, label): None where no report seed ran yet, else its
    # ``row_stats`` (every report seed of it diverged)
    unscored: dict[tuple[str, str], dict[str, Any] | None]
    ablated: dict[tuple[str, str, str], dict[str, Any]]  # ``ablation_stats``
    claims: list[dict[str, Any]]  # judged on the rows and the ablations
    picked: dict[str, dict[str, Any]]  # ``picks``: scenario -> run, also, avoid
    private: dict[str, dict[str, dict[str, Any]]]  # ``privacy_stats``


def judge(matrix: Matrix) -> Evidence:
    """Every statistic, claim and pick the report and ``summary.json`` show, from the cells
    present."""
    stats: dict[str, dict[str, dict[str, Any]]] = {}
    unscored = {}
    for s, scenario in SCENARIOS.items():
        for e in scenario.entries:
            r = row_stats(matrix, s, e)
            if r is not None and r["seeds"]:
                stats.setdefault(s, {})[e.label] = r
            else:
                unscored[(s, e.label)] = r
    ablated = ablation_stats(matrix, stats)
    every_seed_diverged: dict[str, list[str]] = {}
    for (s, label), r in unscored.items():
        if r is not None:
            every_seed_diverged.setdefault(s, []).append(label)
    return Evidence(matrix, stats, unscored, ablated, claims(stats, ablated),
                    picks(stats, every_seed_diverged), privacy_stats(matrix))


def pick_section(evidence: Evidence) -> str:
    if not evidence.picked:
        return ""
    return ("## What to pick\n\nPer scenario at its rounds (every row ran them): run the stable "
            "row with the best mean; also: the stable rows whose paired 95% interval against "
            "it lies at or above -1 point; avoid: rows with an unstable seed, or whose "
            "interval lies below -1 point (uplink a round).\n\n"
            + pick_lines(evidence.picked, evidence.stats)
            + "\nThe same picks as the README's benchmark section gives them (at most "
            f"{README_LINE_CHARS} characters a line):\n\n```markdown\n"
            + readme_lines(evidence.picked, evidence.stats) + "```\n\n")


def claims_section(evidence: Evidence) -> str:
    return "## Paper claims\n\n" + "\n".join(map(claim_line, evidence.claims)) + "\n\n"


def deviations_section(evidence: Evidence) -> str:
    return ("## Deviations from the papers that could move a verdict\n\n"
            + "\n".join(f"- {name}: {text} ([details](../../docs/methods/{page}.md))"
                        for name, page, text in DEVIATIONS) + "\n\n")


def rising_section(evidence: Evidence) -> str:
    flagged = [f"- {s}/{label}: {flag(r)}" for s, rows in evidence.stats.items()
               for label, r in rows.items() if flag(r)]
    if not flagged:
        return ""
    return ("## Rows still rising at their rounds\n\nA claim on such a row rests on a figure "
            "that may still move.\n\n" + "\n".join(flagged) + "\n\n")


def rate_at_end_section(evidence: Evidence) -> str:
    at_end = [f"- {s}/{label}: lr {r['chosen']['lr']} of {searched_rates(r)}"
              for s, rows in evidence.stats.items() for label, r in rows.items()
              if lr_at_grid_end(r)]
    if not at_end:
        return ""
    return ("## Rows whose learning rate is an end of their search\n\nEven after "
            f"{protocol.MAX_LR_STEPS} steps past the grid: a wider search could still move "
            "their figure.\n\n" + "\n".join(at_end) + "\n\n")


def ablations_section(evidence: Evidence) -> str:
    ablations = ablation_table(evidence.ablated, [a for a in protocol.ABLATIONS
                                                  if evidence.matrix.redundant(a)])
    if not ablations:
        return ""
    return ("## Ablations\n\nA row's tuned configuration with one change (a paper method's "
            "mechanism off among them), at its rounds, on the exploratory seeds (all report "
            "seeds for FedFac's random split, a claim's reference).\n\n" + ablations + "\n")


def scenarios_section(evidence: Evidence) -> str:
    parts = []
    for scenario, rows in evidence.stats.items():
        searched_on = SCENARIOS[scenario].searched_on
        parts += [f"## {scenario}\n\n{SCENARIOS[scenario].question}; "
                  f"{evidence.matrix.clients(scenario)} clients"
                  + (f"; each row runs the configuration it chose on {searched_on}"
                     if searched_on else "") + ".\n\n", table(list(rows.values())),
                  f"\n![{scenario}](matrix/accuracy-{scenario}.png)\n\n"]
    return "".join(parts)


def privacy_section(evidence: Evidence) -> str:
    if not evidence.private:
        return ""
    return ("## Differential privacy\n\nEach row below at its tuned configuration and its "
            "scenario's base rounds, on the exploratory seeds, under local DP (each client "
            f"clips its update to L2 norm {protocol.PRIVACY_CLIP_NORM} and adds Gaussian noise "
            "of that times the noise multiplier z; `docs/privacy.md`); epsilon at the delta "
            "shown in `matrix/summary.json`, the most any run of the level spent. Without DP: "
            "the row's report seeds read at the base rounds.\n\n"
            + privacy_tables(evidence.private) + "\n")


def _unstable_line(name: str, r: dict[str, Any]) -> str:
    collapsed = set(r["unstable_seeds"]) - set(r["diverged_seeds"])
    without = (f"{100 * r['accuracy_stable'][0]:.1f} without" if r["accuracy_stable"]
               else "none left without")
    return (f"- {name} ({r['config']}, {r['num_rounds']} rounds): "
            + "; ".join(f"seed {s} {why}" for s, why in r["unstable_why"].items())
            + (f"; mean {100 * r['accuracy'][0]:.1f} with its collapsed seeds, {without}"
               if collapsed else ""))


def unstable_section(evidence: Evidence) -> str:
    shaky = [(f"{s}/{label}", r) for s, rows in evidence.stats.items()
             for label, r in rows.items() if r["unstable_seeds"]]
    shaky += [(f"{s}/{label}", r) for (s, label), r in evidence.unscored.items() if r]
    if not shaky:
        return ""
    return ("## Rows with an unstable report seed\n\nDiverged (stored as such, no accuracy: a "
            "claim on the row or against it is not measured) or collapsed (kept in its "
            "figures and pairs): never picked.\n\n"
            + "\n".join(_unstable_line(name, r) for name, r in shaky) + "\n\n")


def not_run_section(evidence: Evidence) -> str:
    missing = [f"{s}/{label}" for (s, label), r in evidence.unscored.items() if r is None]
    return "## Not run yet\n\n" + ", ".join(missing) + "\n\n" if missing else ""


# the report after its header, in this order
SECTIONS: tuple[Callable[[Evidence], str], ...] = (
    pick_section, claims_section, deviations_section, rising_section, rate_at_end_section,
    ablations_section, scenarios_section, privacy_section, unstable_section, not_run_section)
