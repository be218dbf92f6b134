"""A method's server rule and the narrow view of the run it is given.

The engine (``round_engine.RoundEngine``) runs the rounds and holds a ``MethodRule``; it calls
the rule's hooks at fixed points of a round, in this order:

1. ``start_round(round)``: before the round's messages are built;
2. ``client_identified(client_id, info)``: a node said who it is (at the preflight, or when it
   joins later);
3. ``downlink(round, client_id, arrays)``: what one client receives (its bytes are counted);
4. ``uplink_rows()``: the row masks this round's uplinks are cut to (None: whole tensors);
   every train reply is checked against ``wire.uplink_spec(info, masks)``;
5. ``merge_updates(round, replies, arrays)``: the new shared arrays from the round's valid
   train replies (in client order) and the arrays the round started from;
6. ``after_last_round(grid, arrays)``: work after the last round (FedFac's new clients); what it
   returns goes into results.json.

Besides: ``tables_changed()`` (the ``checkpointed`` tables were restored, or a client id
expired and left the ``client_tables``: rebuild what is derived from them) and
``results_tables()`` (per-client tables shown under ``server_state`` in results.json).

``MethodRule``'s defaults are FedAvg's: every shared array goes down as it is and comes back
merged by the run's ``aggregation.*`` rule (by default the example-weighted mean). A method
overrides the hooks it needs and reaches the run only through its ``RuleContext``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic

from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from flwr.serverapp import Grid

from common.config import MethodSettingsT, RunSettings
from common.protocol import ACTION, ARRAYS, CONFIG, ArraySpec, ClientReply
from strategies.engine.robust import aggregate
from strategies.wire import Masks, WireSpec

if TYPE_CHECKING:
    from strategies.engine.accounting import RoundLedger
    from strategies.engine.exchange import Messenger
    from strategies.engine.identity import NodeDirectory
    from strategies.engine.privacy import PrivacyLedger
    from strategies.engine.replies import ReplyCheck

AFTER_TRAINING = 0  # the ledger's record for what happens after the last round (never a round)


class RuleContext(Generic[MethodSettingsT]):
    """What a method's server rule may use of the run: its settings and wire spec, a
    per-round report, the run's aggregation rule, which clients are known or held out, and
    queries to clients (validated, their bytes counted)."""

    def __init__(self, settings: RunSettings[MethodSettingsT], wire: WireSpec[MethodSettingsT],
                 ledger: RoundLedger, nodes: NodeDirectory, replies: ReplyCheck,
                 messenger: Messenger, privacy: PrivacyLedger) -> None:
        self.settings = settings
        self.wire = wire
        self._ledger = ledger
        self._nodes = nodes
        self._replies = replies
        self._messenger = messenger
        self._privacy = privacy

    def report(self, server_round: int, name: str, value: Any) -> None:
        """A per-round value of the method, a field of that round's entry in results.json."""
        self._ledger.report(server_round, name, value)

    def aggregate(self, replies: list[ClientReply], keys: list[str], reference: ArrayRecord,
                  uniform: bool = False) -> ArrayRecord:
        """``keys`` of the replies' arrays by the run's ``aggregation.*`` rule (``reference``:
        the arrays the round started from, for update clipping; ``uniform``: every client
        counts once instead of by its examples). Under ``dp.mode = "central"``: the noised
        mean of the clipped updates (``keys`` must then be the whole uplink)."""
        if self.settings.dp_mode == "central":
            return self._privacy.merge(replies, keys, reference)
        return aggregate(replies, keys, reference, self.settings, uniform)

    # ------------------------------------------------------------------ clients
    def known_clients(self) -> set[str]:
        """Every client id that has identified itself."""
        return set(self._nodes.client_info)

    def held_out(self) -> set[str]:
        """Client ids kept out of training (a copy)."""
        return set(self._nodes.excluded_clients)

    def hold_out(self, client_id: str) -> None:
        """Keep ``client_id`` out of training and evaluation sampling from now on."""
        self._nodes.excluded_clients.add(client_id)

    def query(self, grid: Grid, action: str, clients: Iterable[str],
              arrays: ArrayRecord | Callable[[str], ArrayRecord] | None,
              metric_keys: tuple[str, ...] | None,
              expected: Callable[[ClientReply], ArraySpec] | None = None,
              server_round: int = AFTER_TRAINING) -> list[ClientReply]:
        """Ask the nodes of ``clients`` to run the method's query ``action`` (with ``arrays``,
        the same for all or per client id); the valid replies (``metric_keys`` and
        ``expected`` arrays as in ``ReplyCheck.valid``). The bytes both ways go into round
        ``server_round``'s record; dropped replies too, under the stage ``action``."""
        nodes = self._nodes.nodes_of(set(clients))
        contents = {}
        for node in nodes:
            sent = arrays(self._nodes.client_of(node)) if callable(arrays) else arrays
            contents[node] = RecordDict({CONFIG: ConfigRecord({ACTION: action}),
                                         **({ARRAYS: sent} if sent is not None else {})})
        batch = self._messenger.query(grid, contents, server_round)  # bytes counted there
        return self._replies.valid(server_round, action, batch, metric_keys, expected)

    def traffic(self, server_round: int = AFTER_TRAINING) -> dict[str, Any]:
        """Bytes down and up, and the dropped replies, recorded under ``server_round``."""
        record = self._ledger.record(server_round)
        return {"bytes_down": record.bytes_down_train + record.bytes_down_evaluate,
                "bytes_up": record.bytes_up,
                **({"dropped": record.dropped} if record.dropped else {})}


class MethodRule(Generic[MethodSettingsT]):
    """FedAvg's server rule; a method's rule overrides the hooks it needs (module docstring).

    ``checkpointed``: attributes saved in the server checkpoint and restored on resume (the
    method's per-client tables; NumPy arrays, ``ArrayRecord``s and JSON values:
    common/durable.py). ``client_tables``: those of them keyed by client id, bounded like the
    node directory's tables (``identity.max-clients``) and forgotten when a client id expires
    (``identity.expire-rounds``)."""

    checkpointed: tuple[str, ...] = ()
    client_tables: tuple[str, ...] = ()

    def __init__(self, run: RuleContext[MethodSettingsT]) -> None:
        self.run = run
        self.settings = run.settings
        self.wire = run.wire

    def start_round(self, server_round: int) -> None:
        return None

    def client_identified(self, client_id: str, info: dict[str, Any]) -> None:
        return None

    def downlink(self, server_round: int, client_id: str | None,
                 arrays: ArrayRecord) -> ArrayRecord:
        return arrays

    def uplink_rows(self) -> Masks | None:
        return None

    def merge_updates(self, server_round: int, replies: list[ClientReply],
                      arrays: ArrayRecord) -> ArrayRecord:
        return self.run.aggregate(replies, list(arrays.keys()), arrays)

    def after_last_round(self, grid: Grid, arrays: ArrayRecord) -> dict[str, Any] | None:
        return None

    def tables_changed(self) -> None:
        return None

    def results_tables(self) -> dict[str, Any]:
        return {}
