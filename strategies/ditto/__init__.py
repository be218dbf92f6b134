"""Ditto (Li et al., ICML 2021): a global model trained as FedAvg, and on each client a
personal model trained towards it with a proximal term; the personal one is evaluated.

Home: ``spec.py`` (settings; what travels: the global model only), ``client.py`` (the two
phases of local training, and the personal model's start), ``models/ditto.py`` (the model
twice: ``shared`` and ``personal``). The server rule is FedAvg's (the default
``MethodRule``) over the global model.
"""

from models.ditto import twin
from strategies.ditto.client import adapt_ditto, train_ditto
from strategies.ditto.spec import DittoSettings, GlobalShared, check
from strategies.method import Method

METHOD = Method(
    "ditto", wire=GlobalShared, local_train=train_ditto, adapt=adapt_ditto,
    settings=DittoSettings, transform=lambda model, settings: twin(model), check=check)
