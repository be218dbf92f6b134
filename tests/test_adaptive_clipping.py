"""Adaptive clipping (Andrew et al. 2021, ``dp.adaptive-clipping``): the clip norm's step,
the clip norm each round's clients are told, and the split of ``dp.noise-multiplier``
between the clipped count and the updates."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.protocol import DP_CLIP_NORM
from strategies.engine.privacy import PrivacyLedger
from tests.test_privacy import (
    SHAPES,
    NoNoise,
    along,
    arrays,
    norm,
    population,
    record,
    reply,
    settings,
)


def test_adaptive_clipping_counts_a_missing_client_as_the_zero_update_the_mean_counts():
    """Andrew et al.'s step over the clients drawn (a fixed denominator): 4 drawn, 2 replied,
    one of them clipped, no noise on the count. The two missing count as zero updates,
    unclipped, as in the mean: 3 of 4 unclipped, so at target quantile 0.5 the clip norm
    moves by exp(-clip-lr * 0.25) (over the arrivals, 1 of 2, it would not move; counting
    the missing as clipped, 1 of 4, it would grow)."""
    run = settings(**{"dp.adaptive-clipping": True, "dp.clip-norm": 1.0,
                      "dp.noise-multiplier": 1.0, "dp.clipped-count-stddev": 5.0})
    start = arrays(np.random.default_rng(7), 1.0)
    ledger = population(PrivacyLedger(run, rng=NoNoise()), 8)
    ledger.merge([reply("0", start, 1.0), reply("1", start, 0.0)], list(SHAPES),
                 record(start), drawn=4)
    assert ledger.clip_norm == pytest.approx(math.exp(-run.dp_clip_lr * 0.25), rel=1e-12)


def test_adaptive_clipping_follows_the_target_quantile_and_bounds_every_update():
    """Clients' update norms spread over [0.5, 4.5]: with target quantile 0.5 the clip norm
    moves from 0.2 towards their median (2.5), and in every round the merge counts no
    update longer than that round's clip norm."""
    run = settings(**{"dp.adaptive-clipping": True, "dp.clip-norm": 0.2,
                      "dp.noise-multiplier": 1.0, "dp.clipped-count-stddev": 5.0})
    ledger = population(PrivacyLedger(run, rng=NoNoise()), 9)
    rng = np.random.default_rng(2)
    start = arrays(rng, 1.0)
    norms = []
    for _ in range(60):
        clip_norm = ledger.message_config()[DP_CLIP_NORM]  # what the round's clients are told
        replies = []
        for i, length in enumerate(np.linspace(0.5, 4.5, 9)):
            replies.append(reply(str(i), along(rng, start, length),
                                 float(length > clip_norm)))  # the client did not clip
        merged, _ = ledger.merge(replies, list(SHAPES), record(start), drawn=9)
        mean_update = {k: merged[k].numpy().astype(np.float64) - start[k] for k in SHAPES}
        assert norm(mean_update) <= clip_norm * (1 + 1e-5)  # a mean of clipped updates
        norms.append(clip_norm)
    assert norms[0] == 0.2 and 2.0 < norms[-1] < 3.0, norms[-5:]


def test_the_noise_multiplier_is_split_between_the_count_and_the_updates_at_the_rounds_norm():
    """Andrew et al.'s split of the noise multiplier z: the clipped count gets standard
    deviation sigma_b, the updates z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2 (above z, so the
    total stays z). The sum's noise is z_delta times the clip norm of *its* round, here
    moved from 1.0 to about 0.37 by ten rounds of unclipped updates; the count's noise is
    read back from the clip norm's steps (a fixed-seed generator: within 2% and 5%)."""
    z, sigma_b, n = 0.8, 0.5, 4
    run = settings(**{"dp.adaptive-clipping": True, "dp.clip-norm": 1.0,
                      "dp.noise-multiplier": z, "dp.clipped-count-stddev": sigma_b,
                      "dp.clip-lr": 0.2, "dp.target-quantile": 0.5})  # e^-0.1 a round
    ledger = population(PrivacyLedger(run, rng=np.random.default_rng(9)), n)
    small = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    big = {"w": np.zeros((200, 300), np.float32)}
    count_noise = []

    def one_round(values: dict[str, np.ndarray]) -> tuple[float, np.ndarray]:
        clip_norm = ledger.message_config()[DP_CLIP_NORM]
        merged, _ = ledger.merge([reply(str(i), values, 0.0) for i in range(n)],
                                 list(values), record(values), drawn=n)
        # log(C' / C) = -clip-lr * ((n - clipped + noise) / n - q), nothing clipped here
        count_noise.append(-math.log(ledger.clip_norm / clip_norm) / run.dp_clip_lr * n
                           - n + run.dp_target_quantile * n)
        return clip_norm, next(iter(merged.values())).numpy()

    for _ in range(10):
        one_round(small)
    clip_norm, noise = one_round(big)  # zero updates: the merge is the noise over n
    assert 0.3 < clip_norm < 0.45
    assert np.std(noise) * n == pytest.approx((z ** -2 - (2 * sigma_b) ** -2) ** -0.5
                                              * clip_norm, rel=0.02)
    for _ in range(2000):
        one_round(small)
    assert np.std(count_noise) == pytest.approx(sigma_b, rel=0.05)
