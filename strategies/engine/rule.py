"""A method's server rule and the narrow view of the run it is given.

The engine (``round_engine.RoundEngine``) runs the rounds and holds a ``MethodRule``; it calls
the rule's hooks at fixed points of a round, in this order:

1. ``client_identified(client_id, info)``: a node said who it is (at the preflight, or when it
   joins later);
2. ``downlink(round, client_id, arrays)``: what one client receives (its bytes are counted);
3. ``uplink_rows()``: the row masks this round's uplinks are cut to (None: whole tensors);
   every train reply is checked against ``wire.uplink_spec(info, masks)``;
4. ``merge_updates(round, replies, arrays)``: the new shared arrays from the round's valid
   train replies (in client order) and the arrays the round started from;
5. ``after_last_round(grid, arrays)``: work after the last round (FedFac's new clients); what it
   returns goes into results.json.

Besides, the rule's own state, as every collaborator of the engine offers it: ``state()``
(what the checkpoint keeps of the rule, under its own key ``"rule"``: a record of NumPy
arrays, ``ArrayRecord``s and JSON values, common/durable.py) and ``restore(state)`` (on
resume), ``forget(client_id)`` (a client id expired, ``identity.expire-rounds``: drop what
is kept of it); ``tables_changed()`` (after a restore, and after the engine forgot expired
client ids: rebuild what is derived from the tables) and ``results_tables()`` (per-client
tables shown under ``server_state`` in results.json).

``MethodRule``'s defaults are FedAvg's: every shared array goes down as it is and comes back
merged by the run's ``aggregation.*`` rule (by default the example-weighted mean). A method
overrides the hooks it needs and reaches the run only through its ``RuleContext``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generic

import numpy as np
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
        self._merge: tuple[int, list[dict[str, Any]]] | None = None  # inside ``merging``

    def report(self, server_round: int, name: str, value: Any) -> None:
        """A per-round value of the method, a field of that round's entry in results.json."""
        self._ledger.report(server_round, name, value)

    def aggregate(self, replies: list[ClientReply], keys: list[str], reference: ArrayRecord,
                  uniform: bool = False, dtype: np.dtype | None = None) -> ArrayRecord:
        """``keys`` of the replies' arrays by the run's ``aggregation.*`` rule (``reference``:
        the arrays the round started from, for update clipping; ``uniform``: every client
        counts once instead of by its examples; ``dtype``: the merged arrays' dtype, float64
        for a mean the rule goes on computing with, else each reference array's). Under
        ``dp.mode = "central"``: the noised mean of the clipped updates over the clients the
        round drew (``keys`` must then be the whole uplink; outside the engine's round, over
        the replies)."""
        if self.settings.dp_mode == "central":
            drawn, notes = self._merge or (len(replies), [])
            merged, note = self._privacy.merge(replies, keys, reference, drawn, dtype)
            notes.append(note)
            return merged
        return aggregate(replies, keys, reference, self.settings, uniform, dtype)

    @contextmanager
    def merging(self, drawn: int) -> Iterator[list[dict[str, Any]]]:
        """The scope of one round's merge (``RoundEngine.merge``), whose round drew ``drawn``
        clients; yields the list that each central-DP merge inside it adds its clipping to
        (for the round's privacy entry)."""
        notes: list[dict[str, Any]] = []
        self._merge = (drawn, notes)
        try:
            yield notes
        finally:
            self._merge = None

    # ------------------------------------------------------------------ clients
    def known_clients(self) -> set[str]:
        """Every client id that has identified itself."""
        return set(self._nodes.client_info)

    def held_out(self) -> set[str]:
        """Client ids kept out of training (a copy)."""
        return set(self._nodes.excluded_clients)

    def hold_out(self, client_id: str) -> None:
        """Keep ``client_id`` out of training and evaluation sampling from now on."""
        self._nodes.exclude(client_id)

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

    A rule with state of its own (per-client tables, a split) declares it as a typed record
    (a ``TypedDict``) returned by ``state()`` and read back by ``restore``; tables keyed by
    client id are bounded like the node directory's (``identity.max-clients``) and lose an
    expired client id in ``forget``."""

    def __init__(self, run: RuleContext[MethodSettingsT]) -> None:
        self.run = run
        self.settings = run.settings
        self.wire = run.wire

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

    def state(self) -> Mapping[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        return None

    def forget(self, client_id: str) -> None:
        return None

    def tables_changed(self) -> None:
        return None

    def results_tables(self) -> dict[str, Any]:
        return {}
