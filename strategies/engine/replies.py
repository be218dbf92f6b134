"""Reading the replies of an exchange: the checks every reply goes through.

``valid_replies`` (evaluate, identify and a method's queries; a round's train exchange, which
may carry an evaluation too, is read with the same stages by ``round_plan.read_round``)
checks each reply's envelope (``common.protocol.parse_reply``) and, where arrays are
expected, their keys, shapes, dtypes and values against the method's wire spec; a reply
that fails is dropped with its reason (log and ``dropped`` in results.json), a node that
did not reply in time likewise, and the round goes on with the rest, unless every reply failed
in the same way (``stop_if_every_reply_failed``): then the run stops with that reason; or
unless training has diverged everywhere (``DivergenceWatch``): then it stops as diverged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

from flwr.app import Message

from common.config import RunSettings
from common.protocol import (
    NO_REPLY,
    NOT_FINITE,
    ArraySpec,
    ClientReply,
    ReplyError,
    check_arrays,
    claimed_client_id,
    client_order,
    parse_reply,
    shared_failure,
    shown,
)
from common.record import RoundRecord, dropped_as_non_finite
from strategies.engine.accounting import RoundLedger
from strategies.engine.exchange import Exchange
from strategies.engine.identity import NodeDirectory
from strategies.engine.robust import ExampleCounts


class RunFailedError(RuntimeError):
    """The run cannot do its job (one line: why); the ServerApp records it and fails.
    ``through_round``: the last round whose work results.json shows (0: none)."""

    def __init__(self, reason: str, through_round: int) -> None:
        super().__init__(reason)
        self.through_round = through_round


def stop_if_every_reply_failed(exchange_name: str, through_round: int, batch: Exchange,
                               min_nodes: int) -> None:
    """Raise ``RunFailedError`` when every reply of ``batch`` is the same failure of the ClientApp
    (``common.protocol.shared_failure``: a bad config, data missing everywhere, a bug): going
    on would only repeat it. At least ``min_nodes`` (the fewest a round needs) must have
    replied so, so that one broken or hostile site never stops a run; fewer failures, and
    nodes that do not reply at all, are dropped replies like any other. ``exchange_name``
    says which exchange in the reason; ``through_round`` is the error's."""
    replies = [reply for _, reply in batch.replies]
    if len(replies) < min_nodes:
        return
    reason = shared_failure(replies)
    if reason is not None:
        raise RunFailedError(f"{exchange_name}: all {len(replies)} clients that replied "
                             f"failed: {reason}", through_round)


# Rounds in a row with no training update accepted and at least min-nodes dropped as not
# finite, after which a run stops as diverged: every client trains again from the same shared
# arrays, and of the evidence matrix's runs none came back after three.
DIVERGED_ROUNDS = 3


class DivergenceWatch:
    """Stops a run whose training diverged everywhere: ``DIVERGED_ROUNDS`` rounds in a row in
    which no training update was accepted and at least ``min_nodes`` nodes' were dropped as
    not finite (going on would only repeat it). A round with an update accepted, or fewer
    such drops (one broken or hostile site), starts the count again. The count is not in the
    checkpoint: a resumed run counts afresh."""

    def __init__(self, min_nodes: int) -> None:
        self.min_nodes = min_nodes
        self.first: int | None = None  # the first round of the rounds in a row so far

    def after_round(self, server_round: int, record: RoundRecord, accepted: int) -> None:
        """Round ``server_round`` trained (``record``: its drops; a training reply whose
        fused evaluation is not finite is dropped whole), ``accepted`` updates merged: raise
        ``RunFailedError`` (its reason says "not finite") at the ``DIVERGED_ROUNDS``-th such
        round in a row."""
        nodes = {d["node"] for d in record.dropped if dropped_as_non_finite(d, "train")}
        if accepted or len(nodes) < self.min_nodes:
            self.first = None
            return
        self.first = server_round if self.first is None else self.first
        if server_round - self.first + 1 >= DIVERGED_ROUNDS:
            raise RunFailedError(
                f"rounds {self.first}-{server_round}: no training update was accepted, "
                f"{len(nodes)} dropped in round {server_round} as {NOT_FINITE}: the run "
                "diverged",
                server_round)


Drop = Callable[[int, str, str], None]
"""(node id, client id or "?", reason): record one dropped reply (``RoundLedger.drop`` under
the round and stage, or stages, the reply was for)."""


def valid_replies(ledger: RoundLedger, nodes: NodeDirectory, server_round: int, stage: str,
                  batch: Exchange, metric_keys: tuple[str, ...] | None, timeout: float,
                  expected_arrays: Callable[[ClientReply], ArraySpec] | None = None,
                  max_examples: int | None = None) -> list[ClientReply]:
    """The replies of ``batch`` that pass every check, in client order (reply order is
    arbitrary; a fixed order makes float sums, and runs, reproducible), in three stages: who
    replied (``note_presence``: bookkeeping only), each reply read (``read_or_error``: no
    bookkeeping), then admitted or dropped (``admitted``).

    Every exchange goes through here (evaluate, identify, a method's queries) or through
    ``round_plan.read_round`` (a round's train exchange, which may carry an evaluation too):
    ``metric_keys`` None for a query (no metrics needed), ``expected_arrays`` the arrays the
    reply must carry (None: it must carry none). Any exception while reading one reply drops
    that reply, with its reason, and the rest go on; a reply whose client id its node may not
    speak for (``NodeDirectory.claim``) is dropped likewise."""
    def drop(node_id: int, client_id: str, reason: str) -> None:
        ledger.drop(server_round, stage, node_id, client_id, reason)

    note_presence(ledger, nodes, None, batch, timeout, drop)
    read = [(node_id, reply, read_or_error(partial(read_reply, node_id, reply, metric_keys,
                                                   expected_arrays, max_examples)))
            for node_id, reply in batch.replies]
    return admitted(nodes, server_round, read, drop)


def note_presence(ledger: RoundLedger, nodes: NodeDirectory, uplink_round: int | None,
                  batch: Exchange, timeout: float, drop: Drop) -> None:
    """The bookkeeping of who replied, before any reply is read: each node that did not
    reply dropped with its reason and counted missing, the others counted present, and (a
    train exchange: ``uplink_round``) every reply's bytes counted whether or not it will
    pass."""
    missing = batch.missing()
    nodes.missed(missing)
    for node_id in missing:
        drop(node_id, nodes.client_of(node_id) or "?",
             f"{NO_REPLY} ({timeout:.0f} s)")
    nodes.answered(node for node, _ in batch.replies)
    if uplink_round is not None:
        for _, reply in batch.replies:
            ledger.uplink(uplink_round, reply)


def read_or_error(read: Callable[[], ClientReply]) -> ClientReply | Exception:
    """What ``read`` (one reply's reading, a ``functools.partial``) returns, or the
    exception it raised: whatever one reply holds, the round goes on."""
    try:
        return read()
    except Exception as error:
        return error


def reason_of(error: Exception) -> str:
    """Why a reply is dropped, in one line: a ``ReplyError``'s own words, else the
    exception's type and (shortened) message."""
    return (str(error) if isinstance(error, ReplyError)
            else f"{type(error).__name__}: {shown(str(error), 200)}")


def admitted(nodes: NodeDirectory, server_round: int,
             read: list[tuple[int, Message, ClientReply | Exception]], drop: Drop
             ) -> list[ClientReply]:
    """The replies that were read and whose node may speak for their client id
    (``NodeDirectory.claim``; an id several nodes claim at once is nobody's), in client
    order; every other one dropped with its reason."""
    contested = nodes.contested([(n, r.client_id) for n, _, r in read
                                 if isinstance(r, ClientReply)])
    valid = []
    for node_id, reply, checked in read:
        try:
            if isinstance(checked, Exception):
                raise checked
            if checked.client_id in contested:
                raise ReplyError(f"client id {checked.client_id} is claimed by several nodes "
                                 "at once, none of which holds it")
            refused = nodes.claim(node_id, checked.client_id, server_round)
            if refused is not None:
                raise ReplyError(refused)
        except Exception as error:
            claimed = claimed_client_id(reply)
            drop(node_id, nodes.client_of(node_id) or (shown(claimed) if claimed else "?"),
                 reason_of(error))
            continue
        valid.append(checked)
    return sorted(valid, key=lambda r: client_order(r.client_id))


def read_reply(node_id: int, reply: Message, metric_keys: tuple[str, ...] | None,
               expected_arrays: Callable[[ClientReply], ArraySpec] | None,
               max_examples: int | None) -> ClientReply:
    """One reply checked: its envelope (``parse_reply``), then its arrays
    (``with_checked_arrays``)."""
    return with_checked_arrays(parse_reply(node_id, reply, metric_keys, max_examples),
                               expected_arrays)


def with_checked_arrays(reply: ClientReply,
                        expected_arrays: Callable[[ClientReply], ArraySpec] | None
                        ) -> ClientReply:
    """``reply`` with its arrays checked against what the method expects of it (None: it
    must carry none); the decoded, checked values replace the received ones."""
    return replace(reply, arrays=check_arrays(reply.arrays, expected_arrays(reply)
                                              if expected_arrays is not None else {}))


class ReplyCheck:
    """``valid_replies`` with the run's ledger, node directory, timeout and example bounds:
    what the engine and a method's queries validate with."""

    def __init__(self, settings: RunSettings, ledger: RoundLedger, nodes: NodeDirectory,
                 example_counts: ExampleCounts) -> None:
        self.settings = settings
        self.ledger = ledger
        self.nodes = nodes
        self.example_counts = example_counts

    def valid(self, server_round: int, stage: str, batch: Exchange,
              metric_keys: tuple[str, ...] | None,
              expected_arrays: Callable[[ClientReply], ArraySpec] | None = None
              ) -> list[ClientReply]:
        """The replies of ``batch`` that pass validation (``metric_keys`` None: a query;
        ``expected_arrays`` None: the reply must carry no arrays), with evaluate example
        counts bounded by each client's first report (``robust.ExampleCounts``)."""
        valid = valid_replies(self.ledger, self.nodes, server_round, stage, batch,
                              metric_keys, self.settings.round_timeout, expected_arrays,
                              max_examples=self.settings.max_num_examples)
        return self.example_counts.bound(stage, valid) if stage == "evaluate" else valid
