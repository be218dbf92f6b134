"""Client-level differential privacy of what leaves a client (docs/privacy.md).

A client's *update* is what it sends minus what it would have sent before training (the same
keys, cut by the same rows: ``WireSpec.build_uplink`` of its starting state). Both modes clip
each update to ``clip_norm`` over all of its arrays together (Flower's
``clip_inputs_inplace``: the FlatClip of McMahan et al. 2018):

- ``dp.mode = "central"``: the client sends its clipped update (added to its start); the
  server clips again (a site that does not clip cannot break the bound) and adds
  ``N(0, (noise_multiplier * clip_norm)^2)`` to the *sum* before dividing by the number of
  updates (``noised_mean``);
- ``"local"``: the client adds that noise to its own clipped update before sending it, so
  the server never sees a clean one.

Noise comes from the operating system's entropy (``secret_rng``), never from the run's
``seed``: every site knows the seed, and noise it could regenerate would protect nothing.

Accounting (``strategies/engine/privacy.py``) is for *replacing one client's data*: two
clipped updates differ by at most twice the clip norm, so the accountant is given
``accounted_noise_multiplier = noise_multiplier / 2``.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.supercore.differential_privacy import clip_inputs_inplace, get_norm

from common.config import ConfigError, RunSettings
from common.protocol import (
    EVAL_ACCURACY,
    EVAL_EXAMPLES,
    EVAL_TASK_ACCURACY,
    EXACT_EVALUATION,
    NUM_EXAMPLES,
    TASK_ACCURACY,
)


def secret_rng() -> np.random.Generator:
    """A generator seeded from the operating system's entropy (``secrets``)."""
    return np.random.default_rng(secrets.randbits(128))


def accounted_noise_multiplier(noise_multiplier: float) -> float:
    """The noise's standard deviation over the sensitivity of one client's contribution
    under replace-one (twice the clip norm): what the accountant is given."""
    return noise_multiplier / 2


def clip_update(sent: list[np.ndarray], start: list[np.ndarray], clip_norm: float) -> float:
    """``sent`` (float64, in place) becomes ``start`` plus its update clipped to
    ``clip_norm`` (L2 over all arrays together, Flower's ``clip_inputs_inplace``); returns
    the update's norm before the clip (above ``clip_norm``: it was clipped). An update no
    longer than ``clip_norm``, zero included, is left as it is."""
    update = [s - t for s, t in zip(sent, start, strict=True)]
    norm = get_norm(update)
    if norm > clip_norm:
        clip_inputs_inplace(update, clip_norm)
        for i, values in enumerate(update):
            sent[i] = start[i] + values
    return norm


def privatize_uplink(uplink: ArrayRecord, start: ArrayRecord, mode: str, clip_norm: float,
                     noise_multiplier: float, rng: np.random.Generator
                     ) -> tuple[ArrayRecord, bool]:
    """A client's uplink under ``mode``: its update over ``start`` clipped (and, ``local``,
    noised with standard deviation ``noise_multiplier * clip_norm``); also whether it was
    clipped. Every array keeps its key, shape and dtype."""
    keys = list(uplink.keys())
    sent = [uplink[k].numpy().astype(np.float64) for k in keys]
    clipped = clip_update(sent, [start[k].numpy().astype(np.float64) for k in keys],
                          clip_norm) > clip_norm
    if mode == "local":
        for values in sent:
            values += rng.normal(0.0, noise_multiplier * clip_norm, values.shape)
    return ArrayRecord({k: Array(values.astype(uplink[k].numpy().dtype))
                        for k, values in zip(keys, sent, strict=True)}), clipped


# What a reply's metrics become under dp.mode = "local" (``released_metrics``): the scores, in
# [0, 1], noised under the same accountant as an update; the example counts fixed at 1 (the
# server's weights become uniform); everything else (losses, timings) withheld
LOCAL_DP_NOISED = ("accuracy", TASK_ACCURACY, EVAL_ACCURACY, EVAL_TASK_ACCURACY)
LOCAL_DP_FIXED = (NUM_EXAMPLES, EVAL_EXAMPLES)


def released_metrics(metrics: Mapping[str, float | int], noise_multiplier: float,
                     exact_evaluation: bool, rng: np.random.Generator) -> dict[str, float | int]:
    """What of a reply's ``metrics`` leaves a client under ``dp.mode = "local"``: nothing
    exact that its data decides. The scores it carries (``LOCAL_DP_NOISED``, each in [0, 1],
    so that replacing the client's data moves the vector of ``k`` of them by at most
    ``sqrt(k)`` in L2) get ``N(0, (noise_multiplier / 2 * sqrt(k))^2)`` each, the noise an
    update's release has per unit of its replace-one sensitivity (``2 * clip_norm``): one
    more release of the same Gaussian mechanism for the accountant; then cut to [0, 1]
    (post-processing). ``exact_evaluation`` (the site's own opt-in, its node config's
    ``dp-exact-evaluation``): the scores go exact, flagged, and are not accounted. Example
    counts become 1; any other metric is withheld."""
    released: dict[str, float | int] = {k: 1 for k in LOCAL_DP_FIXED if k in metrics}
    scores = [k for k in LOCAL_DP_NOISED if k in metrics]
    if scores and exact_evaluation:
        released.update({k: float(metrics[k]) for k in scores})
        released[EXACT_EVALUATION] = 1.0
    elif scores:
        std = noise_multiplier / 2 * math.sqrt(len(scores))
        released.update({k: float(np.clip(float(metrics[k]) + rng.normal(0.0, std), 0.0, 1.0))
                         for k in scores})
    return released


def noised_mean(uploads: list[list[np.ndarray]], start: list[np.ndarray], clip_norm: float,
                noise_std: float, rng: np.random.Generator, drawn: int | None = None
                ) -> tuple[list[np.ndarray], int]:
    """Central DP's merge: ``start`` plus the sum of the clients' updates, each clipped to
    ``clip_norm``, with ``N(0, noise_std^2)`` added, over ``drawn`` (the clients drawn;
    default: the uploads); and how many updates the server itself had to clip (0 for
    clients that clip as they should: a client's clip, rounded to its dtype, may pass the
    norm by its rounding, which is not counted)."""
    total = [np.zeros_like(values, dtype=np.float64) for values in start]
    clipped_here = 0
    slack = 1e-5 * clip_norm + 1e-6 * get_norm(start)
    for upload in uploads:
        sent = [np.asarray(values, np.float64).copy() for values in upload]
        clipped_here += clip_update(sent, start, clip_norm) > clip_norm + slack
        for i, values in enumerate(sent):
            total[i] += values - start[i]
    count = drawn or len(uploads)
    return [start[i] + (total[i] + rng.normal(0.0, noise_std, total[i].shape)) / count
            for i in range(len(start))], clipped_here


def refuse_dp(settings: RunSettings, refused: Mapping[str, str]) -> None:
    """One ``ConfigError`` line when the method cannot run under the run's ``dp.mode``
    (``refused``: mode -> why)."""
    mode = settings.dp_mode
    if mode and mode in refused:
        raise ConfigError(f"dp.mode={mode!r} is not available for method "
                          f"{settings.method!r}: {refused[mode]}")
