"""The server's side of differential privacy (``dp.*``, docs/privacy.md): the clip norm of
each round, central DP's noised merge, adaptive clipping, and the accountant.

Accounting is client-level, for *replacing one client's data* (``strategies/privacy.py``:
the accountant sees half the noise multiplier), with Flower's ``RdpAccountant``
(Google's ``dp-accounting``):

- ``central``: one sampled Gaussian release a round: ``m`` clients drawn without replacement
  from the population of ``N`` clients (the ``num-partitions`` the clients report), the draw
  secret (``random.SystemRandom``: every site knows the run's seed). A round with fewer than
  ``N`` clients eligible is accounted at the sampling ratio it really had (``m`` scaled up).
  The guarantee is against whoever sees the shared model: other clients, the public; the
  server is trusted.
- ``local``: each client's update is its own Gaussian release, composed over the rounds it
  was drawn in, without amplification (the server knows whom it asked). The reported
  epsilon is the most-drawn client's; the guarantee holds against the server too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from functools import lru_cache
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.logger import log
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)
from flwr.supercore.differential_privacy import compute_adaptive_noise_params

from common.config import ConfigError, RunSettings
from common.protocol import (
    DP_CLIP_NORM,
    DP_CLIPPED,
    EXACT_EVALUATION,
    NUM_PARTITIONS,
    ClientReply,
)
from strategies.engine.sampling import Draw, draw_size
from strategies.privacy import accounted_noise_multiplier, noised_mean, secret_rng

# What results.json says of a local-DP run's figures (strategies/privacy.py: released_metrics):
# what the clients noised, what they fixed and what they withheld
LOCAL_RELEASE = {"noised": ["accuracy", "task_accuracy"], "fixed": ["num_examples"],
                 "withheld": ["train loss", "evaluation loss", "client timings"]}


class BudgetSpentError(Exception):
    """The next round would spend more than ``dp.target-epsilon`` (one line: how much)."""


# The largest default delta: the chance the guarantee fails outright must be far below one
# over the number of clients (1 / (10 N)), and small in absolute terms too
DEFAULT_DELTA = 1e-5


def default_delta(population: int) -> float:
    """``min(1e-5, 1 / (10 N))`` for ``N`` clients."""
    return min(DEFAULT_DELTA, 1.0 / (10 * max(population, 1)))


class PrivacyLedger:
    """What the server tracks of a DP run; inert when ``dp.mode`` is ""."""

    def __init__(self, settings: RunSettings, rng: np.random.Generator | None = None) -> None:
        self.settings = settings
        self.mode = settings.dp_mode
        self.clip_norm = settings.dp_clip_norm
        self.population = 0  # N, fixed at the first round
        # local: client id -> its releases (updates sent, and evaluations with noised scores)
        self.participations: dict[str, int] = {}
        self.exact_evaluation: set[str] = set()  # local: sites that opted in to exact scores
        # central: (clients drawn, as accounted) -> rounds; rounds alike compose in one call
        # (the sampled RDP of one event costs about 1.5 s of CPU, its multiples nothing)
        self.releases: dict[int, int] = {}
        self._rng = secret_rng() if rng is None else rng  # a seeded one: tests only

    # ------------------------------------------------------------------ before a round
    def message_config(self) -> dict[str, float]:
        """What every train message carries: this round's clip norm."""
        return {DP_CLIP_NORM: self.clip_norm} if self.mode else {}

    def delta(self) -> float:
        return self.settings.dp_delta or default_delta(self.population)

    def fix_population(self, client_info: dict[str, dict[str, Any]]) -> None:
        """N: the clients' reported ``num-partitions`` (at least the clients known), fixed at
        the preflight; what depends on it is checked then, before any round (one line)."""
        if self.population or not self.mode:
            return
        reported = [int(info.get(NUM_PARTITIONS, 0)) for info in client_info.values()]
        self.population = max([len(client_info), *reported])
        if self.delta() > 1.0 / (10 * self.population):  # a delta the run config set
            log(WARNING, "[privacy] dp.delta=%g is above 1 / (10 N) = %.2g for these %d "
                "clients: the chance that the guarantee fails outright is not small against "
                "one client's (docs/privacy.md#reading-epsilon)", self.delta(),
                1.0 / (10 * self.population), self.population)
        self._noise_multipliers()

    def expected_drawn(self) -> int:
        """The clients a round draws when all ``N`` are eligible."""
        return draw_size(self.population, self.settings.fraction_train)

    def check_budget(self, draw: Draw | tuple[list[str], int]) -> None:
        """Before any message of a round goes out (``draw``: its plan's, ``RoundPlan.draw``):
        raise ``BudgetSpentError`` when the round would spend more than
        ``dp.target-epsilon``."""
        target = self.settings.dp_target_epsilon
        if not self.mode or target == 0:
            return
        projected = self.epsilon(draw)
        if projected > target:
            raise BudgetSpentError(f"dp.target-epsilon={target}: the next round would spend "
                              f"epsilon {projected:.3f} at delta {self.delta():.3g}")

    def _accounted_sample(self, drawn: int, eligible: int) -> int:
        """A round's draw as the accountant sees it: ``drawn`` of ``N``, scaled up to the
        ratio it really had when fewer than ``N`` were eligible."""
        return min(self.population, math.ceil(drawn * self.population / max(eligible, 1)))

    # ------------------------------------------------------------------ merge (central)
    def merge(self, replies: list[ClientReply], keys: list[str], reference: ArrayRecord,
              drawn: int, dtype: np.dtype | None = None
              ) -> tuple[ArrayRecord, dict[str, Any]]:
        """Central DP's merge of the whole uplink: the clipped updates' sum plus noise, over
        the ``drawn`` clients of the round (a drawn client whose update did not arrive counts
        as a zero update: a drop reveals nothing through the mean); adaptive clipping then
        moves the clip norm. Returns the merged arrays (in ``dtype``, else each reference
        array's own) and the merge's clipping, for the round's ``account``."""
        for reply in replies:
            if set(reply.arrays.keys()) != set(keys):
                raise RuntimeError("dp.mode='central' needs one merge of the whole uplink "
                                   f"(merging {sorted(keys)[:3]}... of {len(keys)} keys)")
        drawn = max(drawn, len(replies))
        noise_multiplier, count_std = self._noise_multipliers()
        start = [reference[k].numpy().astype(np.float64) for k in keys]
        merged, clipped_here = noised_mean(
            [[r.arrays[k].numpy() for k in keys] for r in replies], start, self.clip_norm,
            noise_multiplier * self.clip_norm, self._rng, drawn)
        clipped = sum(float(r.metrics.get(DP_CLIPPED, 0.0)) for r in replies)
        note = {"clip_norm": self.clip_norm, "clipped_fraction": clipped / len(replies),
                "clipped_by_server": clipped_here}
        if self.settings.dp_adaptive_clipping:
            # Andrew et al.'s step over the clients drawn, a fixed denominator: a drawn client
            # whose update did not arrive counts as the mean counts it, a zero update, which
            # no clip touches (its bit: unclipped), so a drop shows neither through the mean
            # nor through the next clip norm
            unclipped = drawn - clipped + self._rng.normal(0.0, count_std)
            self.clip_norm *= math.exp(-self.settings.dp_clip_lr * (
                unclipped / drawn - self.settings.dp_target_quantile))
        return ArrayRecord({k: Array(values.astype(
            reference[k].numpy().dtype if dtype is None else dtype))
            for k, values in zip(keys, merged, strict=True)}), note

    def _noise_multipliers(self) -> tuple[float, float]:
        """(the updates' noise multiplier, the clipped count's standard deviation): with
        adaptive clipping the count takes part of ``dp.noise-multiplier`` (Andrew et al.,
        via Flower's ``compute_adaptive_noise_params``; its default ``m / 20`` for the
        ``m`` clients a round draws), so that the total stays it."""
        z = self.settings.dp_noise_multiplier
        if not self.settings.dp_adaptive_clipping:
            return z, 0.0
        expected = self.expected_drawn()
        try:
            count_std, update_z = compute_adaptive_noise_params(
                z, expected, self.settings.dp_clipped_count_stddev or None)
        except ValueError:
            raise ConfigError(
                f"dp.clipped-count-stddev: with {expected} clients a round it must be above "
                f"dp.noise-multiplier / 2 = {z / 2}") from None
        return update_z, count_std

    # ------------------------------------------------------------------ after a round
    def account(self, draw: Draw | tuple[list[str], int], merged: bool,
                note: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Compose the round's releases (``draw``: its plan's; ``merged``: whether the shared
        model changed, ``note``: the clipping its ``merge`` returned); its ``privacy`` entry
        for results.json."""
        if not self.mode:
            return None
        drawn, eligible = draw
        if self.mode == "local":
            for client in drawn:  # every drawn client sent (or may have sent) an update
                self.participations[client] = self.participations.get(client, 0) + 1
        elif merged:
            sample = self._accounted_sample(len(drawn), eligible)
            self.releases[sample] = self.releases.get(sample, 0) + 1
            return self.spent(note)
        return self.spent()

    def spent(self, note: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``privacy`` entry of results.json as the releases stand: epsilon at delta, and
        (``note``) the round's clipping; under local DP what the clients noised, fixed and
        withheld, and the sites that sent exact scores."""
        note = note or {"clip_norm": self.clip_norm, "clipped_fraction": None}
        if self.mode == "local":
            note = {**note, **LOCAL_RELEASE, "exact_evaluation": sorted(self.exact_evaluation)}
        return {"mode": self.mode, "epsilon": self.epsilon(), "delta": self.delta(),
                "noise_multiplier": self.settings.dp_noise_multiplier, **note}

    def scores_released(self, replies: Iterable[ClientReply]) -> bool:
        """Local DP: an evaluation's noised scores are one more release of its client's data
        under the updates' Gaussian mechanism (``strategies.privacy.released_metrics``), so
        each counts like an update; scores a site sent exact (its opt-in, flagged
        ``dp-exact-evaluation``) are not accounted, and the site is named in the privacy
        entry instead. Returns whether any release was counted."""
        if self.mode != "local":
            return False
        counted = False
        for reply in replies:
            if EXACT_EVALUATION in reply.metrics:
                self.exact_evaluation.add(reply.client_id)
            else:
                self.participations[reply.client_id] = (
                    self.participations.get(reply.client_id, 0) + 1)
                counted = True
        return counted

    def epsilon(self, draw: tuple[list[str], int] | None = None) -> float:
        """The epsilon spent so far at ``delta()``; with ``draw`` (a round's clients drawn, of
        how many eligible), as it would be after that round too."""
        z = accounted_noise_multiplier(self.settings.dp_noise_multiplier)
        if self.mode == "local":
            counts = dict(self.participations)
            for client in draw[0] if draw else []:
                counts[client] = counts.get(client, 0) + 1
            return local_epsilon(z, max(counts.values(), default=0), self.delta())
        releases = dict(self.releases)
        if draw:
            sample = self._accounted_sample(len(draw[0]), draw[1])
            releases[sample] = releases.get(sample, 0) + 1
        return central_epsilon(z, self.population, self.delta(),
                               tuple(sorted(releases.items())))

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "population": self.population,
                "participations": self.participations,
                "exact_evaluation": sorted(self.exact_evaluation),
                "releases": [[sample, rounds] for sample, rounds in self.releases.items()]}

    def restore(self, state: dict[str, Any] | None) -> None:
        if not state or not self.mode:
            return
        self.clip_norm = float(state["clip_norm"])
        self.population = int(state["population"])
        self.participations = {k: int(v) for k, v in state["participations"].items()}
        self.exact_evaluation = set(state.get("exact_evaluation", []))
        self.releases = {int(sample): int(rounds) for sample, rounds in state["releases"]}


@lru_cache(maxsize=64)
def central_epsilon(noise_multiplier: float, population: int, delta: float,
                    releases: tuple[tuple[int, int], ...]) -> float:
    """Epsilon of sampled Gaussian releases (``releases``: clients drawn, as accounted ->
    rounds) from ``population`` clients without replacement. Cached: a round's projection
    before its draw goes out is the same computation as its account after the merge, and
    the sampled RDP of one event costs about 1.5 s of CPU."""
    if not releases:
        return 0.0
    accountant = RdpAccountant(PrivacyConfig(
        target_delta=delta, population_size=population,
        neighboring_relation=NeighboringRelation.REPLACE_ONE,
        sampling_method=SamplingMethod.WITHOUT_REPLACEMENT))
    for sample, rounds in releases:
        accountant.compose(GaussianPrivacyEvent(noise_multiplier, sample, population),
                           count=rounds)
    return accountant.get_epsilon(delta)


def local_epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """Epsilon of ``rounds`` Gaussian releases of one client's update (no amplification)."""
    if rounds == 0:
        return 0.0
    accountant = RdpAccountant(PrivacyConfig(
        target_delta=delta, population_size=1,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION))
    accountant.compose(GaussianPrivacyEvent(noise_multiplier, 1, 1), count=rounds)
    return accountant.get_epsilon(delta)
