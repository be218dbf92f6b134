"""Factorized-FL: similarity-matched, per-client aggregation of the rank-1 factors.

Home: ``spec.py`` (settings; what travels: ``u`` and the matching vector), ``server.py``
(similarity matching, one weighted average per client), ``client.py`` (local rule with the
L1 penalty on ``mu``), ``models/factorized_fl.py`` (the factorization).
"""

from models.factorized_fl import MU_DENSITY, factorize, mu_density
from strategies.factorized_fl.client import train_factorized_fl
from strategies.factorized_fl.server import FactorizedFLRule
from strategies.factorized_fl.spec import FactorizedFLSettings, FactorsShared
from strategies.method import Method

METHOD = Method("factorized-fl", wire=FactorsShared, rule=FactorizedFLRule,
                local_train=train_factorized_fl, settings=FactorizedFLSettings,
                train_metrics=lambda model: {MU_DENSITY: mu_density(model)},
                transform=lambda model, settings: factorize(
                    model, settings.method_settings.mu_init),
                dp_refused={"central": "each client's own weighted average is built from "
                                       "the other clients' clean uploads; use "
                                       "dp.mode='local'"})
