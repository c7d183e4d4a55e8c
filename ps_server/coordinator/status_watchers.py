"""Callers that watch the job's status until it is over (ps-ctl status --watch).

A coordinator exits soon after its job ends, once every member has been told; a watcher that
polls every few seconds would then find no coordinator instead of the outcome. The
coordinator therefore stays up, for at most MAX_LINGER_S, until each caller that said it
watches (GetStatusRequest.watching) and read the status within RECENT_S has read it with
the job over. Thread-safe; the clock is injected.
"""

from __future__ import annotations

import threading

from ps_common.clock import Clock

# A watcher that has not read the status for this long is taken to be gone.
RECENT_S = 30.0
# The longest a coordinator stays up for its watchers after its job is over.
MAX_LINGER_S = 15.0


class StatusWatchers:
    def __init__(self, clock: Clock):
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, bool]] = {}  # peer -> (when, saw the job over)

    def read(self, peer: str, job_over: bool) -> None:
        """`peer` (a watcher) read the status; `job_over`: the job was over in it."""
        with self._lock:
            self._last[peer] = (self._clock.monotonic(), job_over)

    def waiting(self) -> bool:
        """Whether a recent watcher has not read the job's outcome yet."""
        now = self._clock.monotonic()
        with self._lock:
            return any(not over and now - when < RECENT_S
                       for when, over in self._last.values())
