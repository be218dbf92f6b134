"""FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the received global model
with the client's local model on its higher layers, before local training.

Home: ``spec.py`` (settings; what travels: the whole model, FedAvg's keys), ``client.py``
(the adaptation where a model arrives; local training is FedAvg's), ``models/fedala.py``
(the element-wise weights beside the higher layers). The server rule is FedAvg's (the
default ``MethodRule``).
"""

from fldata import dataset_shape
from models.fedala import add_weights
from strategies.fedala.client import adapt_fedala
from strategies.fedala.spec import FedALASettings, WholeModelShared, check
from strategies.method import Method

METHOD = Method(
    "fedala", wire=WholeModelShared, adapt=adapt_fedala, settings=FedALASettings,
    transform=lambda model, settings: add_weights(model, dataset_shape(settings)[0],
                                                  settings.method_settings.layers),
    check=check)
