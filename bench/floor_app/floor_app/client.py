"""A ClientApp that imports PyTorch and replies at once: what every message of a plain
Flower PyTorch app costs a site before any work of its own. It answers a preflight query
(``query``) as it answers a round's message (``train``)."""

import os
import signal

import torch  # noqa: F401  (imported, as every PyTorch app's ClientApp imports it)
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

VERSION = 1  # tests/test_site.py changes it between two runs
app = ClientApp()


def _reply(msg: Message) -> Message:
    return Message(RecordDict({"metrics": MetricRecord(
        {"version": VERSION, "pid": os.getpid(), "parent": os.getppid()})}), reply_to=msg)


@app.query()
def preflight(msg: Message, context: Context) -> Message:
    return _reply(msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    if context.run_config["crash"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return _reply(msg)
