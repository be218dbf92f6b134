"""Factorized-FL's local rule: every parameter, cross-entropy + ``l1 * ||mu||_1``.

The penalty is taken from the live parameters, so it has a real gradient (the authors' code
computes it on a detached state dict, where it does nothing).
"""

from __future__ import annotations

from models.factorized_fl import l1_of_mu
from strategies.factorized_fl.spec import FactorizedFLSettings
from strategies.training import LocalTraining, train_epochs


def train_factorized_fl(job: LocalTraining[FactorizedFLSettings]) -> float:
    l1 = job.settings.method_settings.l1
    return train_epochs(job, job.model.parameters(), job.settings.local_epochs,
                        extra_loss=(lambda model: l1 * l1_of_mu(model)) if l1 > 0 else None)
