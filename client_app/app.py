"""The ClientApp: ``train`` runs the method's local rule, ``evaluate`` scores the personalized
model on the client's own test split, ``query`` answers ``identify`` (after the preflight:
this client can serve the run) and the method's own actions. Every reply carries the client's
identity record (``common/protocol.py``); a handler that fails replies with a one-line error
(``error_reply``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from logging import ERROR

import torch
from flwr.app import ArrayRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from client_app.runtime import Client, process_age
from common.config import ConfigError
from common.protocol import (
    ACTION,
    ARRAYS,
    CLIENT,
    CONFIG,
    EVAL_ACCURACY,
    EVAL_CPU,
    EVAL_EXAMPLES,
    EVAL_LOSS,
    EVAL_TASK_ACCURACY,
    EVALUATE_FIRST,
    IDENTIFY,
    METRICS,
    NUM_EXAMPLES,
    SERVER_ROUND,
    TASK_ACCURACY,
    error_reason,
)
from common.seeds import Stream, derived_seed
from strategies.training import LocalTraining

app = ClientApp()
_fresh_process = True  # no message handled in this process yet
Handler = Callable[[Message, Context], Message]


def error_reply(handler: Handler) -> Handler:
    """``handler`` whose exception becomes an error reply with a one-line reason
    (``common.protocol.error_reason``), so that the server can tell a failure every client
    shares (a bad config, data that is not there: the run stops with that line) from a few
    clients failing (their replies are dropped). A ``ConfigError`` is logged as its one line,
    anything else with its traceback, here on the client. Under ``dp.mode = "local"`` only a
    ``ConfigError``'s line (about the run's and the site's settings) leaves the site; any
    other error is named by its type alone."""

    @functools.wraps(handler)
    def replying(msg: Message, context: Context) -> Message:
        try:
            return handler(msg, context)
        except Exception as error:  # whatever it is, the server hears of it in one line
            reason = error_reason(error)
            if context.run_config.get("dp.mode") == "local" and not isinstance(error,
                                                                           ConfigError):
                # its message may quote what the data made (a value, a shape, a count)
                reason = (f"{type(error).__name__}: its message stays on the site under "
                          "dp.mode='local' (the site's log has it)")
            log(ERROR, "%s failed: %s", msg.metadata.message_type, reason,
                exc_info=None if isinstance(error, ConfigError) else error)
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=reason),
                           reply_to=msg)

    return replying


class Phases:
    """Wall seconds of a handler's phases, reported as ``seconds-<phase>`` metrics: start-up
    (process start to the first handler: a deployed SuperNode starts a fresh process per
    message), setup (run config, model template), data (loading this client's split), train,
    evaluate."""

    def __init__(self) -> None:
        global _fresh_process
        self.seconds = {"startup": process_age() if _fresh_process else 0.0}
        _fresh_process = False
        self._mark = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now

    def metrics(self) -> dict[str, float]:
        return {f"seconds-{phase}": value for phase, value in self.seconds.items()}


@app.train()
@error_reply
def train(msg: Message, context: Context) -> Message:
    started = time.process_time()  # CPU time of this handler: the client's work, as a metric
    phases = Phases()
    client = Client.from_context(context)
    phases.lap("setup")
    server_round = int(msg.content[CONFIG][SERVER_ROUND])
    received = msg.content[ARRAYS]
    client.data()  # loaded here, so that the data phase is timed on its own
    phases.lap("data")
    identity = client.identity()
    # the model that arrived, adapted by the method where it has a step for that; under DP,
    # what it would send untrained and unadapted (its update is measured from there)
    model, start = client.arrive(received, server_round - 1, msg.content[CONFIG], identity)
    evaluation = {}
    if msg.content[CONFIG].get(EVALUATE_FIRST, False):
        # the personalized evaluation of the last round: what this client starts from
        eval_started = time.process_time()
        scored = client.evaluate(model, server_round - 1)
        evaluation = {EVAL_ACCURACY: scored.accuracy, EVAL_LOSS: scored.loss,
                      EVAL_TASK_ACCURACY: scored.task_accuracy,
                      EVAL_EXAMPLES: len(client.data().y_test),
                      EVAL_CPU: time.process_time() - eval_started}
        started += evaluation[EVAL_CPU]  # cpu-seconds: the training part only
        phases.lap("evaluate")
    torch.manual_seed(derived_seed(client.settings.seed, server_round, client.partition_id,
                                   Stream.TRAIN))
    loss = client.method.local_train(LocalTraining(
        model, client.loader(train=True, server_round=server_round), client.settings,
        client.device, server_round))
    phases.lap("train")
    # the method's own figures of its trained model (Factorized-FL's mu density)
    own = client.method.train_metrics(model) if client.method.train_metrics else {}
    shared = client.shared_arrays(model, received, identity)
    privacy = {}
    if start is not None:
        shared, privacy = client.privatized(shared, start, msg.content[CONFIG])
        # what it sent is what it keeps: its next update is measured from a value sent
        model.load_state_dict(client.wire.keep_sent(
            model.state_dict(), shared.to_torch_state_dict(), received.to_torch_state_dict()))
    client.keep_personal(model, received, shared, server_round)
    return Message(RecordDict({
        ARRAYS: shared,
        METRICS: client.released({NUM_EXAMPLES: len(client.data().y_train),
                                  "train-loss": float(loss), **evaluation, **privacy,
                                  **own, **phases.metrics(),
                                  "cpu-seconds": time.process_time() - started}),
        CLIENT: identity,
    }), reply_to=msg)


@app.evaluate()
@error_reply
def evaluate_personalized(msg: Message, context: Context) -> Message:
    started = time.process_time()
    phases = Phases()
    client = Client.from_context(context)
    phases.lap("setup")
    received: ArrayRecord = msg.content[ARRAYS]
    config = msg.content[CONFIG]
    client.data()  # timed on its own
    phases.lap("data")
    model = client.arrive(received, int(config[SERVER_ROUND]), config).model
    scored = client.evaluate(model, int(config[SERVER_ROUND]))
    phases.lap("evaluate")
    return Message(RecordDict({
        METRICS: client.released({NUM_EXAMPLES: len(client.data().y_test),
                                  "loss": scored.loss, "accuracy": scored.accuracy,
                                  TASK_ACCURACY: scored.task_accuracy, **phases.metrics(),
                                  "cpu-seconds": time.process_time() - started}),
        CLIENT: client.identity(),
    }), reply_to=msg)


@app.query()
@error_reply
def query(msg: Message, context: Context) -> Message:
    """Server questions: ``identify`` (who are you, once this client has shown it can serve
    the run: ``Client.preflight``), or one of the method's ``actions``."""
    client = Client.from_context(context)
    action = str(msg.content[CONFIG][ACTION])
    if action == IDENTIFY:
        client.preflight()
        return Message(RecordDict({CLIENT: client.identity()}), reply_to=msg)
    if action not in client.method.actions:
        raise ValueError(f"unknown query action {action!r} for method {client.method.name}")
    content = client.method.actions[action](client, msg)
    if METRICS in content.metric_records:
        content[METRICS] = client.released(dict(content[METRICS]))
    content[CLIENT] = client.identity()
    return Message(content, reply_to=msg)
