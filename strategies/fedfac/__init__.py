"""FedFac / FedSplit (Wang, Tang, Li): factor analysis splits elements into shared and personal.

Home: ``spec.py`` (settings; what travels: shared rows and the split), ``server.py`` (the
factor analysis, the ``fedfac.split`` option's reference splits that measure it, aggregation
of shared rows, new-client evaluation), ``client.py`` (plain local training and the
new-client queries), ``models/fedfac.py`` (which layers and parameters make an element;
FedFac has no model transform).
"""

from strategies.fedfac.client import ACTIONS
from strategies.fedfac.server import FedFacRule
from strategies.fedfac.spec import FedFacSettings, SharedRows, check
from strategies.method import Method

METHOD = Method("fedfac", wire=SharedRows, rule=FedFacRule, settings=FedFacSettings,
                check=check, actions=ACTIONS,
                dp_refused={"central": "the factor analysis reads each client's clean rows "
                                       "and its split goes to every client; use "
                                       "dp.mode='local'"})
