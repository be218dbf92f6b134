"""The exchange (strategies/engine/exchange.py) against a SuperLink that is busy: its pulls
answered with HTTP 500 for a while, as Flower 1.42's SuperLink answers when its SQLite store
stays locked past the busy timeout on a loaded machine ("database is locked")."""

from __future__ import annotations

import httpx
import pytest
from flwr.app import Message, MessageType, RecordDict

from strategies.engine import exchange as exchange_module
from strategies.engine.exchange import exchange

pytestmark = pytest.mark.usefixtures("server_task")


def _error(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:9091/v1/runtime/pull-messages")
    return httpx.HTTPStatusError(f"{status}", request=request,
                                 response=httpx.Response(status, request=request))


class BusyLink:
    """A Grid's push and pull: every message is answered at once, but the first
    ``failures`` pulls raise HTTP ``status``."""

    def __init__(self, failures: int, status: int = 500) -> None:
        self.failures, self.status, self.pulls = failures, status, 0
        self.sent: dict[str, Message] = {}

    def push_messages(self, messages: list[Message]) -> list[str]:
        for message in messages:
            message.metadata.__dict__["_message_id"] = message.object_id
            self.sent[message.object_id] = message
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids: set[str]) -> list[Message]:
        self.pulls += 1
        if self.pulls <= self.failures:
            raise _error(self.status)
        return [Message(RecordDict(), reply_to=self.sent.pop(i)) for i in list(message_ids)
                if i in self.sent]


def _messages(n: int) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=10 + k, message_type=MessageType.TRAIN)
            for k in range(n)]


def test_pulls_refused_by_a_busy_superlink_are_tried_again_and_no_reply_is_lost():
    link = BusyLink(failures=3)
    batch = exchange(link, _messages(3), timeout=30)
    assert link.pulls == 4
    assert sorted(node for node, _ in batch.replies) == [10, 11, 12] and not batch.missing()


def test_a_superlink_that_keeps_failing_or_refuses_otherwise_stops_the_exchange(monkeypatch):
    monkeypatch.setattr(exchange_module, "BUSY_SUPERLINK_SECONDS", 0.5)
    busy = BusyLink(failures=10**6)
    with pytest.raises(httpx.HTTPStatusError):
        exchange(busy, _messages(2), timeout=30)
    assert busy.pulls > 2  # tried again until the limit, every POLL_SECONDS
    refusing = BusyLink(failures=1, status=403)
    with pytest.raises(httpx.HTTPStatusError):
        exchange(refusing, _messages(2), timeout=30)
    assert refusing.pulls == 1
