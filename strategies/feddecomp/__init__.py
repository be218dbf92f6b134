"""FedDecomp (Wu et al., ACM MM 2024): average ``sigma``, keep ``tau = B A`` on the client.

Home: ``spec.py`` (settings, what travels), ``client.py`` (the two-phase local rule),
``server.py`` (the mean of ``sigma``, biases and BatchNorm entries over the clients: uniform by
default, as in the paper), ``models/feddecomp.py`` (the decomposition). Every client receives
the same aggregate and adds its own ``tau``.
"""

from models.feddecomp import decompose
from strategies.feddecomp.client import train_feddecomp
from strategies.feddecomp.server import FedDecompRule
from strategies.feddecomp.spec import FedDecompSettings, SigmaShared, check, linear_rank
from strategies.method import Method

METHOD = Method(
    "feddecomp", wire=SigmaShared, rule=FedDecompRule, local_train=train_feddecomp,
    settings=FedDecompSettings,
    transform=lambda model, settings: decompose(
        model, settings.method_settings.rank_conv, linear_rank(settings),
        settings.method_settings.tau_scale),
    check=check)
