"""The ClientApp: ``train`` runs the method's local rule, ``evaluate`` scores the personalized
model on the client's own test split, ``query`` answers ``identify`` and the method's own
actions. Every reply carries the client's identity record (``common/protocol.py``)."""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.runtime import Client
from common.protocol import (
    ACTION,
    ARRAYS,
    CLIENT,
    CONFIG,
    IDENTIFY,
    METRICS,
    NUM_EXAMPLES,
    SERVER_ROUND,
)
from strategies.training import LocalTraining, evaluate

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = time.process_time()  # CPU time of this handler: the client's work, as a metric
    client = Client.from_context(context)
    server_round = int(msg.content[CONFIG][SERVER_ROUND])
    received = msg.content[ARRAYS]
    model = client.model(received, server_round - 1, msg.content[CONFIG])
    torch.manual_seed(client.settings.seed * 7919 + server_round * 31 + client.partition_id)
    loss = client.method.local_train(LocalTraining(
        model, client.loader(train=True, server_round=server_round), client.settings,
        client.device, server_round))
    identity = client.identity()
    shared = client.shared_arrays(model, received, identity)
    client.keep_personal(model, received, shared, server_round)
    return Message(RecordDict({
        ARRAYS: shared,
        METRICS: MetricRecord({NUM_EXAMPLES: len(client.data.y_train),
                               "train-loss": float(loss),
                               "cpu-seconds": time.process_time() - started}),
        CLIENT: identity,
    }), reply_to=msg)


@app.evaluate()
def evaluate_personalized(msg: Message, context: Context) -> Message:
    started = time.process_time()
    client = Client.from_context(context)
    received: ArrayRecord = msg.content[ARRAYS]
    config = msg.content[CONFIG]
    model = client.model(received, int(config[SERVER_ROUND]), config)
    loss, accuracy = evaluate(model, client.loader(train=False), client.device)
    return Message(RecordDict({
        METRICS: MetricRecord({NUM_EXAMPLES: len(client.data.y_test), "loss": loss,
                               "accuracy": accuracy,
                               "cpu-seconds": time.process_time() - started}),
        CLIENT: client.identity(),
    }), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Server questions: ``identify`` (who are you), or one of the method's ``actions``."""
    client = Client.from_context(context)
    action = str(msg.content[CONFIG][ACTION])
    if action == IDENTIFY:
        return Message(RecordDict({CLIENT: client.identity()}), reply_to=msg)
    if action not in client.method.actions:
        raise ValueError(f"unknown query action {action!r} for method {client.method.name}")
    content = client.method.actions[action](client, msg)
    content[CLIENT] = client.identity()
    return Message(content, reply_to=msg)
