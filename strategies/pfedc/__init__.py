"""pFedC: shared representation averaged by all, each class branch only among its holders.

Home: ``spec.py`` (settings; what travels: ``phi`` and the branches a client holds),
``server.py`` (eq. 6 and the masked branch mean of eq. 7, per-client downlinks),
``client.py`` (multi-task local training with MGDA-UB), ``models/pfedc.py`` (the branch
head).
"""

from models.pfedc import with_branches
from strategies.method import Method
from strategies.pfedc.client import train_pfedc
from strategies.pfedc.server import PFedCRule
from strategies.pfedc.spec import HeldBranches, PFedCSettings, check

METHOD = Method("pfedc", wire=HeldBranches, rule=PFedCRule, local_train=train_pfedc,
                settings=PFedCSettings,
                transform=lambda model, settings: with_branches(
                    model, settings.method_settings.tasks),
                check=check,
                dp_refused={"central": "eq. 7 averages each branch over every holder's "
                                       "latest upload, not one noised sum of the round's "
                                       "clients; use dp.mode='local'"})
