"""Task accuracy (pFedC's mean accuracy over tasks, a task being a class): each client's
balanced accuracy on its own test split, computed beside its accuracy from the same
predictions, sent as one number, validated like any metric and averaged unweighted over
clients into ``accuracy_task_mean`` (docs/results.md#task-accuracy)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from client_app.app import evaluate_personalized, train
from client_app.runtime import Client
from common.protocol import (
    ARRAYS,
    CLIENT,
    CONFIG,
    EVAL_ACCURACY,
    EVAL_EXAMPLES,
    EVAL_TASK_ACCURACY,
    EVALUATE_FIRST,
    METRICS,
    NUM_EXAMPLES,
    SERVER_ROUND,
    TASK_ACCURACY,
    identity_record,
)
from common.record import personalized_stats
from comparison.stats import summarize_run
from fldata import dataset_shape
from server_app.tracking import round_metrics
from strategies.engine import RoundEngine, RoundPlan
from strategies.engine.exchange import Exchange
from strategies.registry import REGISTRY, initial_state, load_settings
from strategies.training import accuracy_scores, evaluate_model
from tests.conftest import app_config

# ---------------------------------------------------------------- the helper


def test_nine_right_of_one_class_and_one_wrong_of_another():
    """Accuracy 0.9; task accuracy: class 0 all right (1.0), class 1 all wrong (0.0): 0.5."""
    labels = torch.tensor([0] * 9 + [1])
    predictions = torch.tensor([0] * 9 + [0])
    assert accuracy_scores(predictions, labels) == (0.9, 0.5)


def test_only_the_classes_present_in_the_labels_count():
    """Classes 3 (one of two right) and 7 (right): (0.5 + 1) / 2, whatever else is predicted
    (class 5, absent from the labels, is not a task of this split)."""
    accuracy, task = accuracy_scores(torch.tensor([3, 5, 7]), torch.tensor([3, 3, 7]))
    assert accuracy == pytest.approx(2 / 3)
    assert task == pytest.approx(0.75)


def test_perfect_and_empty():
    assert accuracy_scores(torch.tensor([2, 0, 2]), torch.tensor([2, 0, 2])) == (1.0, 1.0)
    assert accuracy_scores(torch.tensor([], dtype=torch.long),
                           torch.tensor([], dtype=torch.long)) == (0.0, 0.0)
    with pytest.raises(ValueError, match="predictions"):
        accuracy_scores(torch.tensor([1, 2]), torch.tensor([1]))


class Constant(nn.Module):
    """Predicts class 0 for every input (a one-hot logit row per example)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tensor([5.0, 0.0]).expand(len(x), 2)


def test_evaluate_model_counts_classes_across_batches():
    """Batches of 4 split the classes; the task accuracy is still per class over the split:
    6 of class 0 (right) and 2 of class 1 (wrong): accuracy 0.75, task accuracy 0.5."""
    y = torch.tensor([0, 0, 0, 1, 0, 0, 0, 1])
    loader = DataLoader(TensorDataset(torch.zeros(8, 1), y), batch_size=4)
    scored = evaluate_model(Constant(), loader, torch.device("cpu"))
    assert (scored.accuracy, scored.task_accuracy) == (0.75, 0.5)


# ---------------------------------------------------------------- pFedC's client


def _pfedc_client() -> tuple[Client, Context]:
    context = Context(run_id=1, node_id=100,
                      node_config={"partition-id": 0, "num-partitions": 4},
                      state=RecordDict(),
                      run_config=app_config(**{"method": "pfedc", "pfedc.tasks": 0,
                                               "local-epochs": 1}))
    return Client.from_context(context), context


def _branches_deciding(arrays: ArrayRecord, target: int, num_classes: int) -> ArrayRecord:
    """pFedC's branch heads (one per class: logits [class, other]) set so that the C-way
    decision is ``target`` for every input, while the raw class logits favour every other
    class: branch ``target`` says "my class" (logits [1, 0]), the others are sure of "other"
    ([3, 9]: a higher class logit than the target's, a far lower log-probability)."""
    arrays = ArrayRecord(dict(arrays.items()))
    for t in range(num_classes):
        weight = arrays[f"head.branches.{t}.weight"].numpy()
        arrays[f"head.branches.{t}.weight"] = Array(np.zeros_like(weight))
        bias = np.array([1.0, 0.0] if t == target else [3.0, 9.0], dtype=np.float32)
        arrays[f"head.branches.{t}.bias"] = Array(bias)
    return arrays


@pytest.mark.usefixtures("server_task")
def test_pfedc_client_reports_task_accuracy_of_its_branch_head_decisions():
    """Both evaluation paths of the ClientApp (the evaluate message, and the evaluation a
    train reply carries) report accuracy and task accuracy of the branch heads' decision:
    here always ``target``, so accuracy is ``target``'s share of the test split and task
    accuracy one over the number of classes in it (a decision from the raw class logits would
    never say ``target``: both would be 0 for it)."""
    client, context = _pfedc_client()
    y_test = client.data().y_test
    classes, counts = np.unique(y_test, return_counts=True)
    target = int(classes[counts.argmax()])
    _, num_classes = dataset_shape(client.settings)
    arrays = _branches_deciding(initial_state(client.settings).arrays, target, num_classes)
    model = client.model(arrays)
    with torch.no_grad():
        x = torch.from_numpy(client.data().x_test[:8]).to(client.device)
        assert (model(x).argmax(1) == target).all()
        z = model.features(x)  # each branch's class logit, side by side
        raw_logits = torch.stack([model.head.branches[c](z)[:, 0]
                                  for c in range(num_classes)], dim=1)
        assert (raw_logits.argmax(1) != target).all()
    accuracy = float((y_test == target).mean())
    task = 1 / len(classes)
    assert accuracy != pytest.approx(task)  # the two figures differ on this split

    message = Message(RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                      dst_node_id=100, message_type=MessageType.EVALUATE)
    reply = evaluate_personalized(message, context)
    assert not reply.has_error(), reply.error
    metrics = reply.content[METRICS]
    assert metrics["accuracy"] == pytest.approx(accuracy)
    assert metrics[TASK_ACCURACY] == pytest.approx(task)

    message = Message(RecordDict({ARRAYS: arrays, CONFIG: ConfigRecord(
        {SERVER_ROUND: 2, EVALUATE_FIRST: True})}), dst_node_id=100,
        message_type=MessageType.TRAIN)
    reply = train(message, context)
    assert not reply.has_error(), reply.error
    metrics = reply.content[METRICS]
    assert metrics[EVAL_ACCURACY] == pytest.approx(accuracy)
    assert metrics[EVAL_TASK_ACCURACY] == pytest.approx(task)


# ---------------------------------------------------------------- the server


def test_stats_average_task_accuracy_unweighted_over_clients():
    """0.5 for a client of 90 test examples, 1.0 for one of 10: the mean is 0.75 (by
    examples it would be 0.55); a client that sent none is left out and counted."""
    stats = personalized_stats({"0": (0.9, 90), "1": (0.5, 10)}, {"0": 0.5, "1": 1.0})
    assert stats["accuracy_task_mean"] == 0.75
    assert "accuracy_task_num_clients" not in stats
    stats = personalized_stats({"0": (0.9, 90), "1": (0.5, 10), "2": (0.2, 10)},
                               {"0": 0.5, "1": 1.0})
    assert stats["accuracy_task_mean"] == 0.75
    assert stats["accuracy_task_num_clients"] == 2
    assert "accuracy_task_mean" not in personalized_stats({"0": (0.9, 90)})
    # a task accuracy from a client whose evaluation is not in the round is left out
    assert personalized_stats({"0": (0.9, 90)}, {"0": 0.5, "9": 1.0})["accuracy_task_mean"] == 0.5


def _engine():
    settings = load_settings(app_config(method="fedavg"))
    initial, wire = initial_state(settings)
    return RoundEngine(settings, wire, REGISTRY["fedavg"].rule), initial


def _reply(message: Message, partition: int, metrics: dict) -> Message:
    return Message(RecordDict({METRICS: MetricRecord(metrics), CLIENT: identity_record(
        str(partition), partition, 8)}), reply_to=message)


def _read_evaluation(engine: RoundEngine, evaluated: int, sent: list[Message],
                     replies: list[tuple[int, Message]]) -> None:
    """Round ``evaluated``'s evaluation out of the next round's exchange, as the engine reads
    and records it: every node ``sent`` a message evaluates (train messages: fused)."""
    nodes = {m.metadata.dst_node_id: None for m in sent}
    trainers = {m.metadata.dst_node_id: None for m in sent
                if m.metadata.message_type == MessageType.TRAIN}
    read = engine.read(RoundPlan(evaluated + 1, trainers, nodes, evaluated),
                       Exchange(sent, replies))
    engine.evaluation.record_replies(evaluated, read.evaluations, read.fused_evaluations)


@pytest.mark.usefixtures("server_task")
def test_fused_and_separate_evaluations_carry_task_accuracy_and_bad_values_are_dropped():
    """Round 1's evaluation out of round 2's exchange: evaluate replies (task accuracy 0.5;
    none; 1.5, out of range) and train replies carrying the evaluation (1.0; NaN). The
    malformed two are dropped, naming the metric; the one without it still counts for
    accuracy; the task mean is over the two that sent a valid one."""
    engine, _ = _engine()
    evaluate_sent, evaluate_replies = [], []
    for partition, task in ((0, 0.5), (1, None), (2, 1.5)):
        message = Message(RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: 1})}),
                          dst_node_id=100 + partition, message_type=MessageType.EVALUATE)
        metrics = {NUM_EXAMPLES: 10 * (partition + 1), "accuracy": 0.9, "loss": 1.0,
                   **({TASK_ACCURACY: task} if task is not None else {})}
        evaluate_sent.append(message)
        evaluate_replies.append((100 + partition, _reply(message, partition, metrics)))
    train_sent, train_replies = [], []
    for partition, task in ((3, 1.0), (4, math.nan)):
        message = Message(RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: 2})}),
                          dst_node_id=100 + partition, message_type=MessageType.TRAIN)
        metrics = {NUM_EXAMPLES: 50, "train-loss": 1.0, EVAL_ACCURACY: 0.6,
                   EVAL_EXAMPLES: 40, EVAL_TASK_ACCURACY: task}
        train_sent.append(message)
        train_replies.append((100 + partition, _reply(message, partition, metrics)))
    _read_evaluation(engine, 1, train_sent + evaluate_sent, train_replies + evaluate_replies)
    record = engine.ledger.record(1)
    assert record.eval["per_client"] == {"0": 0.9, "1": 0.9, "3": 0.6}
    assert record.eval["accuracy_task_mean"] == 0.75
    assert record.eval["accuracy_task_num_clients"] == 2
    reasons = {d["client"]: d["reason"] for d in record.dropped}
    assert "'task-accuracy' = 1.5 is outside" in reasons["2"]
    assert "'eval-task-accuracy' is not finite" in reasons["4"]


@pytest.mark.usefixtures("server_task")
def test_a_fused_evaluation_weighs_a_client_by_its_first_reported_test_examples():
    """Client 3 reports 40 test examples, then 4,000: its second evaluation still weighs 40
    (inflating its count would pull the weighted accuracy towards its own)."""
    engine, _ = _engine()
    for server_round, inflated in ((1, 40), (2, 4000)):
        sent, replies = [], []
        for partition, accuracy, examples in ((3, 0.6, inflated), (4, 1.0, 40)):
            message = Message(RecordDict({CONFIG: ConfigRecord({SERVER_ROUND: server_round})}),
                              dst_node_id=100 + partition, message_type=MessageType.TRAIN)
            sent.append(message)
            replies.append((100 + partition, _reply(message, partition, {
                NUM_EXAMPLES: 50, "train-loss": 1.0, EVAL_ACCURACY: accuracy,
                EVAL_EXAMPLES: examples})))
        _read_evaluation(engine, server_round, sent, replies)
        assert engine.ledger.record(server_round).eval["accuracy_weighted"] == \
            pytest.approx(0.8)


@pytest.mark.usefixtures("server_task")
def test_the_evaluate_exchange_records_task_accuracy(monkeypatch):
    """The two-exchange protocol (and the last round of the fused one): the evaluate
    exchange's replies give the round's ``accuracy_task_mean``."""
    engine, initial = _engine()
    tasks = {100: 0.25, 101: 0.75}
    engine.evaluation.draw({100: "0", 101: "1"})

    def send(grid, messages):
        return Exchange(messages, [(m.metadata.dst_node_id, _reply(m, m.metadata.dst_node_id
                                                                   - 100, {
            NUM_EXAMPLES: 10, "accuracy": 0.5, "loss": 1.0,
            TASK_ACCURACY: tasks[m.metadata.dst_node_id]})) for m in messages])

    monkeypatch.setattr(engine.messenger, "send", send)
    engine.evaluate_round(None, 1, initial)
    evaluation = engine.ledger.record(1).eval
    assert evaluation["accuracy_task_mean"] == 0.5
    assert "accuracy_task_num_clients" not in evaluation


# ---------------------------------------------------------------- what reads results.json


def _results(task: bool) -> dict:
    rounds = [{"round": r, "bytes_up": 1024**2, "bytes_down": 0, "seconds": 1.0, "eval": {
        "accuracy_weighted": weighted, "accuracy_mean": 0.5, "accuracy_min": 0.1,
        **({"accuracy_task_mean": task_mean} if task else {})}}
        for r, weighted, task_mean in ((1, 0.6, 0.5), (2, 0.7, 0.6))]
    final = {"accuracy_weighted": 0.7, "accuracy_mean": 0.5, "accuracy_min": 0.1,
             "accuracy_task_mean": 0.6 if task else None, "bytes_up_total": 2 * 1024**2,
             "seconds_total": 2.0}
    return {"rounds": rounds, "final": final}


def test_summaries_and_tracking_keep_the_task_mean():
    summary = summarize_run(_results(task=True))
    assert summary["accuracy_task_per_round"] == [0.5, 0.6]
    assert summary["accuracy_task_mean"] == 0.6
    before = summarize_run(_results(task=False))  # a results.json written before it existed
    assert "accuracy_task_per_round" not in before and "accuracy_task_mean" not in before
    assert round_metrics(_results(task=True)["rounds"][0])["accuracy/task_mean"] == 0.5
