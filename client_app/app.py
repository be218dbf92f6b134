"""The ClientApp: ``train`` runs the method's local rule, ``evaluate`` scores the personalized
model on the client's own test split. Both reply with the client id in a ConfigRecord."""

from __future__ import annotations

import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from client_app.runtime import Client
from client_app.training import LocalTraining, evaluate

app = ClientApp()


def _identity(client: Client) -> ConfigRecord:
    return ConfigRecord({"client-id": client.client_id, "partition-id": client.partition_id,
                         "num-partitions": int(client.context.node_config["num-partitions"]),
                         **client.method.client_info(client.data, client.settings)})


@app.train()
def train(msg: Message, context: Context) -> Message:
    started = time.process_time()  # CPU time of this handler: the client's work, as a metric
    client = Client.from_context(context)
    server_round = int(msg.content["config"]["server-round"])
    received = msg.content["arrays"]
    model = client.model(received, server_round - 1, msg.content["config"])
    torch.manual_seed(client.settings.seed * 7919 + server_round * 31 + client.partition_id)
    loss = client.method.local_train(LocalTraining(
        model, client.loader(train=True, server_round=server_round), client.settings,
        client.device, server_round))
    shared = client.shared_arrays(model, received)
    client.keep_personal(model, received, shared, server_round)
    return Message(RecordDict({
        "arrays": shared,
        "metrics": MetricRecord({"num-examples": len(client.data.y_train),
                                 "train-loss": float(loss),
                                 "cpu-seconds": time.process_time() - started}),
        "client": _identity(client),
    }), reply_to=msg)


@app.evaluate()
def evaluate_personalized(msg: Message, context: Context) -> Message:
    started = time.process_time()
    client = Client.from_context(context)
    received: ArrayRecord = msg.content["arrays"]
    config = msg.content["config"]
    model = client.model(received, int(config["server-round"]), config)
    loss, accuracy = evaluate(model, client.loader(train=False), client.device)
    return Message(RecordDict({
        "metrics": MetricRecord({"num-examples": len(client.data.y_test), "loss": loss,
                                 "accuracy": accuracy,
                                 "cpu-seconds": time.process_time() - started}),
        "client": _identity(client),
    }), reply_to=msg)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Server questions: ``identify`` (who are you), or one of the method's ``actions``."""
    client = Client.from_context(context)
    action = str(msg.content["config"]["action"])
    if action == "identify":
        return Message(RecordDict({"client": _identity(client)}), reply_to=msg)
    if action not in client.method.actions:
        raise ValueError(f"unknown query action {action!r} for method {client.method.name}")
    content = client.method.actions[action](client, msg)
    content["client"] = _identity(client)
    return Message(content, reply_to=msg)
