"""FedDecomp (Wu et al., ACM MM 2024): average ``sigma``, keep ``tau = B A`` on the client.

Home: ``spec.py`` (settings, what travels), ``client.py`` (the two-phase local rule),
``models/feddecomp.py`` (the decomposition). The server is the plain ``PersonalizedStrategy``:
the example-weighted mean of ``sigma`` (and of biases and BatchNorm entries), the same
aggregate sent to every client, which adds its own ``tau``.
"""

from models.feddecomp import decompose
from strategies.feddecomp.client import train_feddecomp
from strategies.feddecomp.spec import FedDecompSettings, SigmaShared, check
from strategies.method import Method

METHOD = Method(
    "feddecomp", wire=SigmaShared, local_train=train_feddecomp, settings=FedDecompSettings,
    transform=lambda model, settings: decompose(model, settings.method_settings.rank_conv,
                                                settings.method_settings.rank_linear),
    check=check)
