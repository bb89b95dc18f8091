"""Fleet: stateless chat-turn workers on Redis. The client API and the ``fleet`` CLI."""

from fleet.client import (
    AsyncFleet,
    Fleet,
    Restart,
    SubmitNotNotified,
    TurnHandle,
    TurnStream,
    TurnTimeout,
    TurnTooLarge,
    UnknownTier,
)

__all__ = ["AsyncFleet", "Fleet", "Restart", "SubmitNotNotified", "TurnHandle", "TurnStream", "TurnTimeout",
           "TurnTooLarge", "UnknownTier"]
