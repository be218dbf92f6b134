"""What one client is: identity, device, data, and its personal state (contracts §1 and §6)."""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass, field
from functools import lru_cache
from logging import INFO, WARNING
from pathlib import Path
from typing import NamedTuple

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from client_app.site_floor import check_site_floor
from common.config import ConfigError, RunSettings
from common.durable import write_atomic
from common.protocol import (
    CLIENT_ID,
    CLIENT_ID_PATTERN,
    DP_CLIP_NORM,
    DP_CLIPPED,
    EXACT_EVALUATION,
    NUM_PARTITIONS,
    PARTITION_ID,
    identity_record,
    is_client_id,
)
from common.seeds import Stream, derived_seed
from fldata import ClientData, load_client_data
from fldata.cache import site_cache_dir
from strategies.method import Method
from strategies.privacy import privatize_uplink, released_metrics, secret_rng
from strategies.registry import REGISTRY, load_settings
from strategies.training import Arrival, Evaluation, LocalTraining, evaluate_model
from strategies.wire import WireSpec

PERSONAL = "personal-state"


def process_age() -> float:
    """Seconds since this process started (0.0 where ``/proc`` is not there): at a handler's
    entry in a fresh ``flwr-clientapp`` process, its start-up and imports."""
    try:
        with open("/proc/self/stat") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def select_device(setting: str) -> torch.device:
    """``auto``: this client's own CUDA device when one is visible (Ray gives each
    simulated client its own through ``CUDA_VISIBLE_DEVICES``), else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting.startswith("cuda") and not torch.cuda.is_available():
        # Ray empties the variable for a simulated client given no GPU share, on a machine
        # with GPUs as on one without: the usual cause where the machine has one
        hint = (" (CUDA_VISIBLE_DEVICES is empty: Ray gives a simulated client a GPU only with "
                "client-resources-num-gpus above 0, on a machine that has one; else use device "
                "auto or cpu)" if os.environ.get("CUDA_VISIBLE_DEVICES") == "" else "")
        raise ConfigError(f"device: {setting!r} asked for, but no CUDA device is visible"
                          + hint)
    return torch.device(setting)


def use_thread_budget() -> None:
    """PyTorch's CPU threads as many as ``OMP_NUM_THREADS`` says (Ray sets it for each
    simulated client, a deployment for each site). PyTorch takes the count from the
    environment when it is imported; in a process that imported it before the variable was
    set (a Ray worker that preloads PyTorch, ``launch/ray_head.py``), it would keep the
    machine's core count, and clients sharing the cores would each run that many threads."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


@lru_cache(maxsize=4)
def _settings(run_config_json: str) -> RunSettings:
    """The run's settings, parsed and checked once per process (the checks build the model:
    a simulation worker serving many clients would pay it on every message)."""
    return load_settings(json.loads(run_config_json))


@lru_cache(maxsize=4)
def _wire_spec(run_config_json: str) -> WireSpec:
    """The run's wire spec, once per process (built on the ``meta`` device: no weights)."""
    settings = _settings(run_config_json)
    return REGISTRY[settings.method].wire_spec(settings)


EXACT_EVALUATION_ENV = "PFLOWER_DP_EXACT_EVALUATION"


@lru_cache(maxsize=4)
def _client_data(run_config_json: str, partition_id: int, num_partitions: int,
                 data_dir: str | None, state_dir: str | None,
                 data_cache: str | None = None) -> ClientData:
    """The split, cached where the site says (``data_cache``: its node config's
    ``data-cache``, else under ``state_dir``); the run config may only turn the cache off."""
    settings = _settings(run_config_json)
    cache_dir = site_cache_dir(settings.data_cache, data_cache, state_dir)
    return load_client_data(settings, partition_id, num_partitions, data_dir, cache_dir)


def read_state_file(path: Path, client_id: str) -> dict | None:
    """A personal-state file (``torch.load(weights_only=True)``: plain tensors, no code), or
    None with a log line when it does not load (truncated, corrupt, foreign): the caller
    falls back to the previous round's file."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        int(saved["round"])
        dict(saved["personal"])
        return saved
    except Exception as error:
        log(WARNING, "client %s: personal state %s does not load (%s: %s); falling back to "
            "the previous round's file", client_id, path, type(error).__name__,
            str(error)[:200])
        return None


class Arrived(NamedTuple):
    """The model a message brought (``Client.arrive``)."""

    model: nn.Module  # personal state, the received arrays on top, then the method's adapt
    start: ArrayRecord | None  # under dp.mode: what it would send before adapting, training


@dataclass
class Client:
    """One client in one message: settings, who it is, its data and its device."""

    context: Context
    settings: RunSettings
    method: Method
    client_id: str
    partition_id: int
    device: torch.device
    wire: WireSpec
    run_config_json: str = field(repr=False)  # the key of this process's caches

    @classmethod
    def from_context(cls, context: Context) -> Client:
        run_config_json = json.dumps(dict(context.run_config), sort_keys=True)
        settings = _settings(run_config_json)
        node = context.node_config
        if PARTITION_ID not in node or NUM_PARTITIONS not in node:
            raise ConfigError("node config: partition-id and num-partitions are required "
                              "(simulation sets them; on a SuperNode use --node-config)")
        partition_id = int(node[PARTITION_ID])
        client_id = str(node.get(CLIENT_ID, partition_id))
        use_thread_budget()
        if not is_client_id(client_id):  # it names this client's personal-state files
            raise ConfigError(f"node config: client-id {client_id!r} is not a safe id "
                              f"(pattern {CLIENT_ID_PATTERN.pattern})")
        # a run below the site's own privacy floor gets nothing from this site
        check_site_floor(node, settings, client_id)
        return cls(context, settings, REGISTRY[settings.method], client_id, partition_id,
                   select_device(settings.device), _wire_spec(run_config_json),
                   run_config_json)

    @property
    def num_partitions(self) -> int:
        return int(self.context.node_config[NUM_PARTITIONS])

    def identity(self) -> ConfigRecord:
        """The ``client`` record of every reply: who this is, plus the method's entries."""
        return identity_record(self.client_id, self.partition_id, self.num_partitions,
                               self.wire.client_info(self.data()))

    def preflight(self) -> None:
        """Show, before any training, that this client can serve the run: its split loads
        (or its cached split reads; the partition is feasible) and the run's model builds and
        moves to its device. Whatever fails raises, and the identify reply says why."""
        self.data()
        self.method.build_model(self.settings).to(self.device)

    # -------------------------------------------------------------------- data
    def data(self) -> ClientData:
        """This client's split: loaded (or read from the partition cache) at the first call
        in this process, then kept."""
        node = self.context.node_config
        data_dir = str(node["data-dir"]) if node.get("data-dir") else None
        state_dir, data_cache = node.get("state-dir"), node.get("data-cache")
        return _client_data(self.run_config_json, self.partition_id, self.num_partitions,
                            data_dir, str(state_dir) if state_dir else None,
                            str(data_cache) if data_cache else None)

    def loader(self, train: bool, server_round: int = 0) -> DataLoader:
        data = self.data()
        x, y = (data.x_train, data.y_train) if train else (data.x_test, data.y_test)
        dataset = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        generator = torch.Generator().manual_seed(derived_seed(
            self.settings.seed, server_round, self.partition_id, Stream.SHUFFLE))
        return DataLoader(dataset, batch_size=self.settings.batch_size, shuffle=train,
                          generator=generator, pin_memory=self.device.type == "cuda")

    def evaluate(self, model: nn.Module, server_round: int) -> Evaluation:
        """Loss, accuracy and task accuracy of the personalized ``model`` of round
        ``server_round`` on this client's test split (``strategies.training.evaluate_model``:
        the argmax of the model's output is its prediction, pFedC's branch-head class scores
        included). A method with ``fine_tune`` (FedAvg-FT) first trains a copy of it
        on the train split, seeded by the round (the same in both evaluation protocols);
        ``model`` itself is left as it was."""
        if self.method.fine_tune is not None:
            model = copy.deepcopy(model)
            torch.manual_seed(derived_seed(self.settings.seed, server_round, self.partition_id,
                                           Stream.FINE_TUNE))
            self.method.fine_tune(LocalTraining(model, self.loader(True, server_round),
                                                self.settings, self.device, server_round))
        return evaluate_model(model, self.loader(train=False), self.device)

    # -------------------------------------------------------------------- model and state
    @property
    def state_file(self) -> Path | None:
        state_dir = self.context.node_config.get("state-dir")
        return Path(str(state_dir)) / f"{self.client_id}.pt" if state_dir else None

    @property
    def previous_state_file(self) -> Path | None:
        """The state of the round before the latest (see ``keep_personal``)."""
        path = self.state_file
        return path.with_suffix(".prev.pt") if path else None

    def personal_state(self, up_to_round: int | None = None,
                       message_config: ConfigRecord | None = None) -> dict[str, torch.Tensor]:
        """This client's personal parameters: from ``context.state``, else from
        ``state-dir`` (after a SuperNode restart, or in a resumed run), else nothing.

        From disk it takes the newest saved state whose round is at most ``up_to_round`` and
        that this run saved, or, in a resumed run, one of the runs it continues saved up to
        the checkpoint's round (the server sends ``resume-runs`` and ``resume-round`` in
        ``message_config``). So a run stopped during round k+1 and resumed from its round-k
        checkpoint never trains on the half-finished round's state, and an unrelated run's
        file in the same ``state-dir`` is never used."""
        if PERSONAL in self.context.state:
            return self.context.state[PERSONAL].to_torch_state_dict()
        config = message_config or {}
        resume_runs = {str(r) for r in config.get("resume-runs", [])}
        resume_round = int(config.get("resume-round", 0))
        found, usable = [], []
        for path in (self.state_file, self.previous_state_file):
            if path is None or not path.exists():
                continue
            saved = read_state_file(path, self.client_id)
            if saved is None:
                continue
            saved_round, run_id = int(saved["round"]), str(saved.get("run-id"))
            found.append(f"{path.name}: run {run_id} round {saved_round}")
            if up_to_round is not None and saved_round > up_to_round:
                continue
            if run_id == str(self.context.run_id) or (run_id in resume_runs
                                                      and saved_round <= resume_round):
                usable.append((saved_round, path, saved))
        if not usable:
            if found and resume_runs:
                log(WARNING, "client %s: no usable personal state in state-dir (%s; resuming "
                    "runs %s up to round %d): starting fresh", self.client_id,
                    ", ".join(found), sorted(resume_runs), resume_round)
            return {}
        saved_round, path, saved = max(usable, key=lambda c: c[0])
        log(INFO, "client %s: restored personal state from %s (round %s)",
            self.client_id, path, saved_round)
        return saved["personal"]

    def model(self, received: ArrayRecord, up_to_round: int | None = None,
              message_config: ConfigRecord | None = None) -> nn.Module:
        """The run's model with this client's personal state (see ``personal_state``), then
        the received shared arrays on top."""
        return self._merged(self.personal_state(up_to_round, message_config), received)

    def _merged(self, personal: dict[str, torch.Tensor], received: ArrayRecord) -> nn.Module:
        model = self.method.build_model(self.settings)
        own = {**model.state_dict(), **personal}
        model.load_state_dict(self.wire.merge_downlink(own, received.to_torch_state_dict()))
        return model.to(self.device)

    def arrive(self, received: ArrayRecord, arrays_round: int,
               message_config: ConfigRecord | None = None,
               identity: ConfigRecord | None = None) -> Arrived:
        """Where a model arrives: every train and evaluate message calls this once, before
        its evaluation and training. The run's model with this client's personal state and
        the received arrays on top (``model``), then the method's ``adapt`` step
        (``Method.adapt``, if it has one) on it in place, with this client's train split,
        seeded by ``arrays_round`` (the round the received arrays are of: the train message
        of round r+1 and the evaluate message of round r adapt alike, so both evaluation
        protocols score the same model). Under ``dp.mode``, given the reply's ``identity``
        (a train message), ``start`` is what the client would send before adapting and
        training: its update is measured from there, so whatever the adaptation moves is
        inside the clipped update."""
        own = self.personal_state(arrays_round, message_config)
        model = self._merged(own, received)
        start = (self.shared_arrays(model, received, identity)
                 if self.settings.dp_mode and identity is not None else None)
        if self.method.adapt is not None:
            torch.manual_seed(derived_seed(self.settings.seed, arrays_round, self.partition_id,
                                           Stream.ADAPT))
            self.method.adapt(Arrival(model, self.loader(True, arrays_round), self.settings,
                                      self.device, arrays_round,
                                      received.to_torch_state_dict(), own))
        return Arrived(model, start)

    def keep_personal(self, model: nn.Module, received: ArrayRecord, sent: ArrayRecord,
                      server_round: int = 0) -> None:
        """Everything that is not both received and sent back is personal (the server will
        not return it): keep it in ``context.state`` and, with ``state-dir``, on disk.

        On disk: written durably (``common.durable.write_atomic``: fsync of the file and its
        directory, then the rename); the state of the previous round moves to
        ``<client-id>.prev.pt`` first, so the last two rounds' states are there for a resume
        from the previous round's checkpoint (a current file that does not load is not moved
        over the previous one)."""
        keep = set(self.wire.always_personal)
        personal = {k: v.detach().cpu() for k, v in model.state_dict().items()
                    if k in keep or not (k in received and k in sent)}
        self.context.state[PERSONAL] = ArrayRecord(personal)
        path = self.state_file
        if path is None:
            return
        current = read_state_file(path, self.client_id) if path.exists() else None
        if current is not None and current["round"] != server_round:
            os.replace(path, self.previous_state_file)  # a file that does not load is not kept
        write_atomic(path, lambda f: torch.save({
            "run-id": self.context.run_id, "method": self.settings.method,
            "round": server_round, "personal": personal}, f))

    def shared_arrays(self, model: nn.Module, received: ArrayRecord,
                      identity: ConfigRecord | None = None) -> ArrayRecord:
        """The uplink: what the method's wire spec says this client sends, given the reply's
        ``client`` record (``identity``; default: this client's)."""
        return ArrayRecord(self.wire.build_uplink(
            model.state_dict(), received.to_torch_state_dict(),
            self.identity() if identity is None else identity))

    def privatized(self, uplink: ArrayRecord, start: ArrayRecord, config: ConfigRecord
                   ) -> tuple[ArrayRecord, dict[str, float]]:
        """The uplink under the run's ``dp.mode`` (``strategies/privacy.py``): the update over
        ``start`` clipped to the message's clip norm (``local``: and noised here), and,
        ``central``, the metric saying whether it was clipped (the trusted server's adaptive
        clipping and report use it; under ``local`` it would leave without noise)."""
        settings = self.settings
        clip_norm = float(config.get(DP_CLIP_NORM, settings.dp_clip_norm))
        sent, clipped = privatize_uplink(uplink, start, settings.dp_mode, clip_norm,
                                         settings.dp_noise_multiplier, secret_rng())
        return sent, ({DP_CLIPPED: float(clipped)} if settings.dp_mode == "central" else {})

    def released(self, metrics: dict[str, float | int]) -> MetricRecord:
        """A reply's ``metrics`` as they leave this client: as they are, or under ``dp.mode =
        "local"`` nothing exact its data decides (``strategies.privacy.released_metrics``:
        scores noised, or exact where this site opted in with its node config's
        ``dp-exact-evaluation``, or ``PFLOWER_DP_EXACT_EVALUATION=1`` in its environment;
        example counts 1; the rest withheld)."""
        if self.settings.dp_mode != "local":
            return MetricRecord(metrics)
        # the site's opt-in: its node config, or (a simulation's sites have no node config
        # of their own) the environment its ClientApps run in
        exact = (str(self.context.node_config.get(EXACT_EVALUATION, "")).lower() in ("true", "1")
                 or os.environ.get(EXACT_EVALUATION_ENV) == "1")
        return MetricRecord(released_metrics(metrics, self.settings.dp_noise_multiplier,
                                             exact, secret_rng()))
