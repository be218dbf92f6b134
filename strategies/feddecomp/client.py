"""FedDecomp's local rule: first ``tau`` (``sigma`` frozen), then ``sigma`` (``tau`` frozen).

``feddecomp.lora-epochs`` epochs train only the low-rank factors ``A``, ``B``; the remaining
``local-epochs - lora-epochs`` epochs train every other parameter (``sigma``, biases,
BatchNorm), each phase with a fresh optimizer. BatchNorm running statistics follow the data in
both phases (the model is in train mode), as in the paper's code. ``lora-epochs`` below
``local-epochs`` is checked at start (``spec.check``, ``leaves_shared_epochs``): as many or
more would leave no epoch to the shared part (``sigma``, biases, BatchNorm), which would then
never be trained. The authors train ``tau`` 2 of 5 epochs
(``local-epochs=5 feddecomp.lora-epochs=2``).
"""

from __future__ import annotations

from models.feddecomp import is_personal_key
from strategies.feddecomp.spec import FedDecompSettings
from strategies.training import LocalTraining, train_epochs


def train_feddecomp(job: LocalTraining[FedDecompSettings]) -> float:
    lora_epochs = job.settings.method_settings.lora_epochs
    named = list(job.model.named_parameters())
    tau = [p for name, p in named if is_personal_key(name)]
    sigma = [p for name, p in named if not is_personal_key(name)]
    loss = train_epochs(job, tau, lora_epochs)
    sigma_epochs = job.settings.local_epochs - lora_epochs
    return train_epochs(job, sigma, sigma_epochs) if sigma_epochs > 0 else loss
