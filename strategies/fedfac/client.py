"""FedFac's client rule: plain local training (FedAvg's), plus the answers to the server's
queries for the paper's evaluation of new clients (table 3).

- ``fedfac.personal``: an existing client returns its analysed layers' element tensors (shared
  and personal rows). This is the only time personal elements leave a client, and it happens
  only when ``fedfac.new-clients > 0``, for the Ensemble evaluation; never under ``dp.mode``.
- ``fedfac.localtrain``: a new client takes the shared part (rows + masks, as in a downlink),
  trains only its personal rows of the analysed layers for ``local-epochs`` (every other
  parameter and every shared row stays fixed), and reports its accuracy.
- ``fedfac.ensemble``: a new client averages the softmax predictions of the existing clients'
  personalized models (``member.<i>.<key>`` arrays on top of the received shared model) on its
  own test split, and reports the accuracy.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from common.config import ConfigError
from common.protocol import ARRAYS, METRICS, NUM_EXAMPLES, TASK_ACCURACY
from strategies.fedfac.spec import MEMBER_PREFIX, SharedRows
from strategies.method import ClientSide
from strategies.training import LocalTraining, accuracy_scores, evaluate_model, train_epochs


def personal_elements(client: ClientSide, msg: Message) -> RecordDict:
    if client.settings.dp_mode:  # the client's own refusal: under DP it trusts no server
        raise ConfigError("fedfac.personal: under dp.mode this client sends no personal rows")
    model = client.model(ArrayRecord())
    state = model.state_dict()
    return RecordDict({ARRAYS: ArrayRecord({k: state[k].cpu()
                                            for k in client.wire.always_personal}),
                       METRICS: MetricRecord({NUM_EXAMPLES: len(client.data().y_train)})})


def local_train_personal_rows(client: ClientSide, msg: Message) -> RecordDict:
    received = msg.content[ARRAYS]
    model = client.model(received)
    wire: SharedRows = client.wire
    masks = wire.masks_of(received.to_torch_state_dict())
    trainable, hooks = [], []
    for name, param in model.named_parameters():
        layer = wire.layer_of_key.get(name)
        if layer is None or layer not in masks:
            continue
        shared = masks[layer].to(param.device)
        hooks.append(param.register_hook(
            lambda grad, shared=shared: grad.masked_fill(
                shared.view(-1, *([1] * (grad.dim() - 1))), 0.0)))
        trainable.append(param)
    loss = train_epochs(LocalTraining(model, client.loader(True, 0), client.settings,
                                      client.device, 0), trainable, client.settings.local_epochs)
    for hook in hooks:
        hook.remove()
    scores = evaluate_model(model, client.loader(False), client.device)
    return RecordDict({METRICS: MetricRecord({
        NUM_EXAMPLES: len(client.data().y_test), "accuracy": scores.accuracy,
        TASK_ACCURACY: scores.task_accuracy, "loss": scores.loss, "train-loss": loss})})


@torch.no_grad()
def ensemble_accuracy(client: ClientSide, msg: Message) -> RecordDict:
    received = msg.content[ARRAYS]
    base = ArrayRecord({k: v for k, v in received.items() if not k.startswith(MEMBER_PREFIX)})
    members: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in received.items():
        if key.startswith(MEMBER_PREFIX):
            member, name = key[len(MEMBER_PREFIX):].split(".", 1)
            members.setdefault(member, {})[name] = torch.from_numpy(value.numpy())
    models = []
    for state in members.values():
        model = client.model(base)
        model.load_state_dict({**model.state_dict(), **{k: v.to(client.device)
                                                        for k, v in state.items()}})
        models.append(model.eval())
    predictions, labels = [], []
    for x, y in client.loader(False):
        probs = torch.stack([m(x.to(client.device)).softmax(1) for m in models]).mean(0)
        predictions.append(probs.argmax(1))
        labels.append(y)
    predicted, truth = torch.cat(predictions), torch.cat(labels)
    accuracy, task_accuracy = accuracy_scores(predicted, truth)
    return RecordDict({METRICS: MetricRecord({NUM_EXAMPLES: len(truth), "accuracy": accuracy,
                                              TASK_ACCURACY: task_accuracy})})


ACTIONS = {"fedfac.personal": personal_elements,
           "fedfac.localtrain": local_train_personal_rows,
           "fedfac.ensemble": ensemble_accuracy}
