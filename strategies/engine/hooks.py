"""The hooks a method's server rule may implement, and their contract (written once, here).

A method's ``strategies/<method>/server.py`` subclasses ``engine.Strategy`` and overrides
some of these; ``Strategy`` has the defaults (FedAvg's). The engine calls them at fixed points
of a round (``Strategy.train_round``); none of them sends messages, except
``after_training``, which may (through ``Strategy.messenger.query``).

What a hook may use of the engine: ``settings`` (typed in the method's own settings),
``wire`` (its wire spec), ``report(round, name, value)`` (a per-round value in
results.json), ``aggregate_keys`` (the run's ``aggregation.*`` rule over some keys),
``nodes`` (the node directory), ``replies`` (validation) and ``messenger`` (queries).
"""

from __future__ import annotations

from typing import Any, Protocol

from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from common.protocol import ClientReply
from strategies.wire import Masks


class MethodHooks(Protocol):
    # Attributes saved in the server checkpoint and restored on resume (the method's
    # per-client tables; NumPy arrays, ``ArrayRecord``s and JSON values: common/durable.py).
    checkpointed: tuple[str, ...]
    # Those of them keyed by client id: bounded like the node directory's tables
    # (``identity.max-clients``) and forgotten when a client id expires
    # (``identity.expire-rounds``).
    client_tables: tuple[str, ...]

    def begin_round(self, server_round: int) -> None:
        """Before the round's train messages are built."""

    def on_identified(self, client_id: str, info: dict[str, Any]) -> None:
        """A node told the server who it is (``info``: its ``client`` record), at the start
        or when it joins later."""

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        """What one client receives this round (``client_id`` None: a node not identified).
        Default: the shared arrays as they are. Its bytes are counted."""
        ...

    def uplink_masks(self) -> Masks | None:
        """Row masks the clients' uplinks are cut to this round (None: whole tensors); the
        engine checks every train reply against ``wire.uplink_spec(info, masks)``."""
        ...

    def aggregate_train(self, server_round: int, replies: list[ClientReply],
                        arrays: ArrayRecord) -> ArrayRecord:
        """The new shared arrays from the round's valid train replies (in client order) and
        the arrays the round started from. Default: the run's ``aggregation.*`` rule over
        every shared key (by default the example-weighted mean). Flower's word for it."""
        ...

    def after_training(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        """Work after the last round (FedFac's new-client evaluation); what it returns goes
        into results.json."""
        ...

    def client_tables_changed(self) -> None:
        """The ``checkpointed`` tables were just restored from a checkpoint, or a client id
        expired and its entries left the ``client_tables``: rebuild what is derived from
        them (Factorized-FL's similarity matching)."""

    def state_tables(self) -> dict[str, Any]:
        """Server-side per-client tables, keyed by client id, shown under ``server_state``
        in results.json."""
        ...
