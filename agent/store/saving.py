"""How the agent lives with a state store that cannot be written (a full disk, an I/O error).

The agent keeps alerting from memory; what it could not save stays pending (offsets, alerts,
detector memory) and goes into the next save that works. Saves are retried with a backoff
(1 s doubling to ``limits.state_save_retry_max``, 60 s by default, so a full disk is not
hammered every evaluation interval; SIGTERM tries once more regardless). Reported once per cause,
not per attempt: one ``state`` error naming the cause when the saves start failing (or fail for
another cause), one warning when they work again; every failed attempt counts in
``precision_agent_state_save_failures_total{cause}``, and ``precision_agent_state_unsaved`` is 1
while the state on disk is behind the agent's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..health import Health
from .causes import StateError

log = logging.getLogger("precision_agent")

MIN_DELAY = 1.0
MAX_DELAY = 60.0


class SaveTracker:
    def __init__(self, health: Health, path: Path, max_delay: float = MAX_DELAY) -> None:
        self.health, self.path = health, path
        self.max_delay = max_delay       # the backoff's ceiling (limits.state_save_retry_max)
        self.cause: str | None = None   # why the last save failed; None while saves work
        self.failures = 0                # failed attempts since the last save that worked
        self.delay = 0.0
        self.next_try = 0.0

    def due(self, now: float) -> bool:
        """Whether a save may be tried now (always, unless the last one failed recently)."""
        return self.cause is None or now >= self.next_try

    def failed(self, exc: StateError, now: float, what: str = "save state") -> None:
        self.health.inc_labelled("state_save_failures", exc.cause)
        self.health.set("state_unsaved", 1)
        self.failures += 1
        self.delay = min(self.max_delay, max(MIN_DELAY, self.delay * 2))
        self.next_try = now + self.delay
        if exc.cause != self.cause:
            self.cause = exc.cause
            self.health.error("state", "cannot %s (%s): %s; alerting goes on from memory, the save is retried "
                              "every %g s at most and further failures of this cause are only counted "
                              "(precision_agent_state_save_failures_total)", what, exc.cause, exc, self.max_delay)

    def succeeded(self) -> None:
        if self.cause is not None:
            log.warning("state saved again to %s after %d failed attempt(s) (%s)", self.path, self.failures,
                        self.cause)
        self.cause, self.failures, self.delay, self.next_try = None, 0, 0.0, 0.0
        self.health.set("state_unsaved", 0)
