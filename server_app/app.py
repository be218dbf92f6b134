"""The ServerApp: validate the run config, build the round engine with the method's rule,
run the rounds, write results.json after each one."""

from __future__ import annotations

from logging import ERROR, INFO, WARNING

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from common.config import ConfigError, RunSettings
from common.protocol import error_reason
from server_app.results import ResultsRecorder, output_dir
from server_app.rounds import check_resumable, load_checkpoint, resume, run_rounds
from server_app.tracking import Tracking
from strategies.engine import RoundEngine, RunFailedError
from strategies.registry import REGISTRY, initial_state, load_settings
from strategies.wire import WireSpec

app = ServerApp()


def nothing_personal(settings: RunSettings, wire: WireSpec) -> str | None:
    """The start-up warning for a personalized method that keeps nothing personal on the
    run's model (FedBN on a model without BatchNorm): it silently runs as FedAvg."""
    if not REGISTRY[settings.method].personalized or wire.personal_keys:
        return None
    return (f"{settings.method} keeps nothing personal on this model (model "
            f"{settings.model or 'of the dataset'!r}): every parameter is shared, so it runs "
            "as FedAvg (docs/methods/)")


@app.main()
def main(grid: Grid, context: Context) -> None:
    checkpoint = None
    try:
        settings = load_settings(context.run_config)
        initial, wire = initial_state(settings)
        if settings.resume_from:
            checkpoint = load_checkpoint(settings.resume_from)
            check_resumable(checkpoint, settings.raw)
        out_dir = output_dir(settings)
        # last: a run refused above leaves no tracking run open
        tracking = Tracking(settings.trackers(), out_dir, settings.raw)
    except ConfigError as error:
        log(ERROR, "Invalid run config: %s", error)
        # An Exception (not SystemExit) is what marks the run as failed in Flower.
        raise ConfigError(str(error)) from None
    engine = RoundEngine(settings, wire, REGISTRY[settings.method].rule)
    recorder = ResultsRecorder(settings, engine, out_dir, tracking)
    log(INFO, "[start] method %s on %s (%s), results in %s", settings.method,
        settings.dataset, settings.partitioner, recorder.out_dir)
    if (warning := nothing_personal(settings, wire)) is not None:
        log(WARNING, "[start] %s", warning)
    first_round, arrays = 1, initial
    run_ids = [str(context.run_id)]  # this run and the runs it continues
    if checkpoint is not None:
        first_round, arrays = resume(checkpoint, engine, recorder)
        earlier = [str(r) for r in checkpoint.get("run_ids", [])]
        run_ids = [*earlier, *run_ids]
        # Clients may continue from personal state saved by these runs, up to this round.
        engine.set_message_config({"resume-round": checkpoint["round"],
                                   **({"resume-runs": earlier} if earlier else {})})
    try:
        engine.identify(grid, first_round)
        arrays, stopped = run_rounds(grid, engine, recorder, arrays, first_round,
                                     settings.num_server_rounds, run_ids)
        if (missing := recorder.missing_evaluation()) is not None:
            raise RunFailedError(missing, recorder.last_round)
        recorder.finish(engine.after_training(grid, arrays), reason=stopped)
    except RunFailedError as failure:
        # results.json says so, and the exception marks the run failed in Flower (its
        # status details carry the reason: the launchers print them)
        recorder.fail(str(failure), failure.through_round)
        raise
    except Exception as error:
        recorder.fail(error_reason(error), recorder.last_round)
        raise
