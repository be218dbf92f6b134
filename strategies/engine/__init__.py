"""The round engine every method runs on (``strategy.py``: the round's stages in order; the
hooks a method may override: ``hooks.py``)."""

from strategies.engine.replies import RunFailedError
from strategies.engine.strategy import Strategy

__all__ = ["RunFailedError", "Strategy"]
