"""The server side every method shares; see ``strategy.py`` for the hooks a method may
override."""

from strategies.personalized.replies import RunFailedError
from strategies.personalized.strategy import PersonalizedStrategy

__all__ = ["PersonalizedStrategy", "RunFailedError"]
