"""Who a round draws: how many (``draw_size``), by which generator (``Sampler``), and what
the draw is, for the round's plan (``Drawn``) and for the privacy accountant (``Draw``)."""

from __future__ import annotations

import random
from typing import Any, NamedTuple

from common.config import RunSettings

Drawn = dict[int, str | None]
"""node -> client id (None: a node not identified yet)."""


class Draw(NamedTuple):
    """A round's draw as the privacy accountant counts it (``round_plan.RoundPlan.draw``)."""

    clients: list[str]
    """An id per node drawn (a node not identified yet by ``node-<id>``)."""
    eligible: int
    """How many nodes it was drawn from."""

    @classmethod
    def of(cls, drawn: Drawn, eligible: int) -> Draw:
        """The draw of the nodes ``drawn`` of ``eligible`` (0: of as many as were drawn)."""
        return cls([c or f"node-{n}" for n, c in drawn.items()], eligible or len(drawn))


def draw_size(eligible: int, fraction: float) -> int:
    """How many of ``eligible`` nodes a round draws at ``fraction``: rounded down, as
    Flower's own strategies sample, but at least one and at most all."""
    return min(eligible, max(int(eligible * fraction), 1))


class Sampler:
    """What draws the rounds' clients: a secret draw under central DP (subsampling amplifies
    only when nobody can tell who was drawn), else a generator of the run's own, seeded with
    ``seed``. Never the module's global one: Flower's heartbeat thread draws from it at times
    that vary between runs, which made a run's draws vary too."""

    def __init__(self, settings: RunSettings) -> None:
        self.secret = settings.dp_mode == "central"
        self._random = random.SystemRandom() if self.secret else random.Random(settings.seed)

    def draw(self, eligible: list[int], fraction: float) -> list[int]:
        """A ``fraction`` of the ``eligible`` nodes (at least one; none of none)."""
        return self._random.sample(eligible, draw_size(len(eligible), fraction))

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> Any:
        """The generator's state (None: a secret draw has none to keep)."""
        return None if self.secret else self._random.getstate()

    def restore(self, state: Any) -> None:
        if state is not None and not self.secret:
            version, internal, gauss = state
            self._random.setstate((version, tuple(internal), gauss))
