"""FedFac / FedSplit (Wang, Tang, Li): factor analysis splits elements into shared and personal.

Home: ``spec.py`` (settings; what travels: shared rows and the split), ``server.py`` (the
factor analysis, aggregation of shared rows, new-client evaluation), ``client.py`` (plain
local training and the new-client queries), ``models/fedfac.py`` (which layers and
parameters make an element; FedFac has no model transform). The benchmarks' reference
splits (``fedfac.split``) are ``strategies/reference_splits.py``, outside its home.
"""

from strategies.fedfac.client import ACTIONS
from strategies.fedfac.server import FedFacStrategy
from strategies.fedfac.spec import FedFacSettings, SharedRows, check
from strategies.method import Method

METHOD = Method("fedfac", wire=SharedRows, strategy=FedFacStrategy, settings=FedFacSettings,
                check=check, actions=ACTIONS)
