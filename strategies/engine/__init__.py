"""The round engine every method runs on: ``round_engine.RoundEngine`` runs the rounds and
holds a method's server rule (``rule.MethodRule``: the hooks, in the order a round calls
them), which sees the run through a ``rule.RuleContext``. Outside this package only these
names are used."""

from strategies.engine.privacy import BudgetSpentError
from strategies.engine.replies import RunFailedError
from strategies.engine.round_engine import RoundEngine
from strategies.engine.round_plan import RoundOutcome, RoundPlan
from strategies.engine.rule import AFTER_TRAINING, MethodRule, RuleContext

__all__ = ["AFTER_TRAINING", "BudgetSpentError", "MethodRule", "RoundEngine", "RoundOutcome",
           "RoundPlan", "RuleContext", "RunFailedError"]
