"""What a method is made of (contracts §7): the ``Method`` record.

A method's home is ``strategies/<method>/`` (or ``strategies/baselines.py`` for the seven
baselines) plus its model transform in ``models/<method>.py``:

- ``spec.py``: its settings (a ``KeyGroup`` of its run-config keys) and its wire spec (a
  ``WireSpec``: what goes down and up, used by both sides);
- ``server.py``: its server rule (a ``MethodRule`` overriding hooks of ``engine/rule.py``);
- ``client.py``: its local training rule (``LocalTraining -> float``), its ``adapt`` step where
  a model arrives (``Arrival -> None``; optional) and the answers to its own server queries
  (``actions``);
- ``__init__.py``: the ``Method`` record below, which ``strategies/registry.py`` lists.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, Protocol

import torch
from flwr.app import ArrayRecord
from torch import nn
from torch.utils.data import DataLoader

from common.config import MethodSettingsT, RunSettings
from fldata import ClientData, dataset_shape, default_model
from models import build_backbone
from strategies.engine import MethodRule
from strategies.training import Arrival, LocalTraining, train_everything
from strategies.wire import WireSpec


class InitialState(NamedTuple):
    arrays: ArrayRecord  # the shared arrays round 1 sends
    wire: WireSpec


def keep_model(model: nn.Module, settings: RunSettings) -> nn.Module:
    return model


def no_checks(settings: RunSettings, model: nn.Module) -> None:
    return None


class ClientSide(Protocol):
    """What a method's query handler (``Method.actions``) may use of the client it runs on
    (``client_app/runtime.py: Client``)."""

    settings: RunSettings
    wire: WireSpec
    device: torch.device

    def data(self) -> ClientData: ...

    def model(self, received: ArrayRecord) -> nn.Module: ...

    def loader(self, train: bool, server_round: int = 0) -> DataLoader: ...


@dataclass(frozen=True)
class Method(Generic[MethodSettingsT]):
    """A method's pieces.

    ``settings``: its run-config keys (parsed into ``RunSettings.method_settings``);
    ``wire``: its wire spec class; ``rule``: its server rule; ``local_train``: its client
    rule; ``transform``: its model transform (applied to the seeded backbone); ``check``: rules
    across keys (e.g. a phase that must fit in ``local-epochs``), given the model built on the
    ``meta`` device (no memory, no data); ``actions``: answers to the
    server's ``query`` messages (``action`` name -> ``handler(client, message) ->
    RecordDict``); ``dp_refused``: the ``dp.mode`` values it refuses, with why;
    ``fine_tune``: a rule that trains a copy of the received model on the
    client's train split before each personalized evaluation (FedAvg-FT; nothing of it is sent,
    and training starts from the received model, not from the copy); ``adapt``: a step where a
    model arrives, once per train and evaluate message, on the client's model with the
    received arrays merged in and its train split (``Arrival``), before the fused evaluation
    and the local rule: both see the adapted model (FedALA's adaptive local aggregation,
    Ditto's personal model started from the first global model a client receives). It is
    seeded by the round the arrays are of, so that both evaluation protocols score the same
    model; under ``dp.mode`` the update is measured from the model before it, so whatever it
    moves is inside the clipped update (``client_app/runtime.py: Client.arrive``)."""

    name: str
    wire: type[WireSpec[MethodSettingsT]] = WireSpec
    rule: type[MethodRule[MethodSettingsT]] = MethodRule
    local_train: Callable[[LocalTraining[MethodSettingsT]], float] = train_everything
    settings: type[MethodSettingsT] | None = None
    transform: Callable[[nn.Module, RunSettings[MethodSettingsT]], nn.Module] = keep_model
    check: Callable[[RunSettings[MethodSettingsT], nn.Module], None] = no_checks
    actions: dict[str, Callable[..., Any]] = field(default_factory=dict)
    fine_tune: Callable[[LocalTraining[MethodSettingsT]], float] | None = None
    adapt: Callable[[Arrival[MethodSettingsT]], None] | None = None
    # a method's own metrics of its model after local training, sent with the train reply
    # (Factorized-FL's mu density); withheld under dp.mode = "local" like every other figure
    train_metrics: Callable[[nn.Module], dict[str, float]] | None = None
    # False: the method shares everything by design (FedAvg, FedProx, FedAvg-FT); a
    # personalized method with nothing personal on the run's model is warned about at start
    personalized: bool = True
    # dp.mode -> why the method cannot run under it (docs/privacy.md): its server reads
    # something the mode's noise does not cover
    dp_refused: dict[str, str] = field(default_factory=dict)

    def build_model(self, settings: RunSettings) -> nn.Module:
        """The run's model, identical on the server and on every client: initialised from
        ``seed`` in a fork of the CPU generator, so that the caller's random state is left as
        it was (the train handler seeds its own)."""
        input_shape, num_classes = dataset_shape(settings)
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(settings.seed)
            backbone = build_backbone(default_model(settings), input_shape, num_classes,
                                      settings.mlp_hidden)
            return self.transform(backbone, settings)

    def wire_spec(self, settings: RunSettings, model: nn.Module | None = None) -> WireSpec:
        """The run's wire spec, from ``model`` or, without one, from the model built on the
        ``meta`` device (a wire spec needs the model's structure, not its weights)."""
        if model is None:
            with torch.device("meta"):
                model = self.build_model(settings)
        return self.wire(model, settings)

    def initial_state(self, settings: RunSettings) -> InitialState:
        """What the server starts from: the shared part of the seeded model (built once)
        and the wire spec."""
        model = self.build_model(settings)
        wire = self.wire_spec(settings, model)
        state = model.state_dict()
        return InitialState(ArrayRecord({k: state[k] for k in wire.shared_keys}), wire)
