"""Bounded data-path streams: at most `max_streams` Pull and Push calls at once, and none
left waiting on a silent peer for longer than `idle_timeout_s`.

Without these bounds a few clients that open streams and then go quiet (a stalled worker, a
host that vanished mid-push: TCP may take hours to notice) hold every handler thread, and
healthy pulls fail with DEADLINE_EXCEEDED. Here:

- `admit` refuses a stream beyond `max_streams` at once (ResourceExhausted, naming
  --max-streams); the server's handler pool has room for those, for as many unary pushes
  waiting for their ssp/sync steps, and `CONTROL_PLANE_THREADS` more (`handler_threads`), so
  a refusal, control-plane calls (AssignShards), health checks and reflection always find a
  thread.
- A handler marks the spans in which it waits on its peer (`Stream.requests` around a
  request iterator; `arm()`/`disarm()` around a response generator's `yield`). One watchdog
  thread cancels a stream that has waited `idle_timeout_s` in one span: `context.cancel()`
  makes a blocked request iterator raise grpc.RpcError and closes a response generator at its
  `yield` (GeneratorExit), so the handler unwinds, releases its slot and frees its thread; the
  peer sees CANCELLED. Time the server itself spends (waiting for a shard's lock, applying a
  push) never counts as idle.

No grpc import: `context` is anything with `cancel()` and `peer()`.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Iterator, TypeVar

from ps_common.clock import Clock, SystemClock
from ps_common.errors import NotReady, Overloaded

log = logging.getLogger(__name__)

# Handler threads beyond max_streams: for control-plane calls, health checks, reflection and
# for refusing the streams over the limit.
CONTROL_PLANE_THREADS = 16

T = TypeVar("T")


def handler_threads(max_streams: int) -> int:
    """The size of a parameter server's handler pool for a given --max-streams: the streams,
    the unary pushes waiting for their ssp/sync steps (a server takes at most --max-streams
    clients in its steps, ps_server.consistency), and the control plane's threads. Threads
    are started as calls need them."""
    return 2 * max_streams + CONTROL_PLANE_THREADS


class Stream:
    """One admitted data-path stream; a context manager that gives its slot back on exit.

    Used by the one handler thread that runs the call; the watchdog only reads its deadline
    and cancels it.
    """

    __slots__ = ("_limiter", "_context", "method", "peer", "deadline", "cut")

    def __init__(self, limiter: "StreamLimiter", context, method: str):
        self._limiter = limiter
        self._context = context
        self.method = method
        self.peer = context.peer()
        self.deadline = math.inf  # armed: when the wait on the peer becomes too long
        self.cut = False  # cancelled by the watchdog

    def arm(self) -> None:
        """The handler starts waiting on its peer (it yields a response, or reads a request)."""
        self.deadline = self._limiter._clock.monotonic() + self._limiter.idle_timeout_s

    def disarm(self) -> None:
        """The wait is over: the peer delivered (or took) a message. Raises NotReady when
        the watchdog has cut the stream already (it is being cancelled): the handler must
        not go on to apply a push whose call ends CANCELLED. Under the watchdog's lock, so
        that a stream is either cut or disarmed, never both."""
        with self._limiter._lock:
            self.deadline = math.inf
            if self.cut:
                raise NotReady(
                    f"{self.method} from {self.peer} was cancelled: its peer was silent for "
                    f"{self._limiter.idle_timeout_s:g} s (--stream-idle-timeout)")

    def requests(self, iterator: Iterator[T]) -> Iterator[T]:
        """`iterator` (a request stream), armed while each next message is awaited."""
        while True:
            self.arm()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self.disarm()
            yield item

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self._limiter._release(self)


class StreamLimiter:
    """Thread-safe. Admission of data-path streams, and the idle watchdog that cuts stalled
    ones (see the module docstring). `start()` starts the watchdog thread, `stop()` ends it
    (idempotent; streams still open are left to the server's own shutdown).
    """

    def __init__(self, *, max_streams: int, idle_timeout_s: float, name: str = "ps-server",
                 clock: Clock | None = None):
        if max_streams < 1:
            raise ValueError(f"--max-streams {max_streams} must be >= 1")
        if not idle_timeout_s > 0:
            raise ValueError(f"--stream-idle-timeout {idle_timeout_s} must be > 0")
        self.max_streams = max_streams
        self.idle_timeout_s = idle_timeout_s
        self._name = name
        self._clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last stream ends
        self._open: set[Stream] = set()
        self._draining = False
        self._stopping = threading.Event()
        self._watchdog: threading.Thread | None = None

    @property
    def active(self) -> int:
        """Streams admitted and not yet finished."""
        with self._lock:
            return len(self._open)

    def admit(self, context, method: str) -> Stream:
        """A slot for one Pull or Push call, or Overloaded (RESOURCE_EXHAUSTED with a retry
        delay, which PSClient honours with backoff) when all are taken."""
        stream = Stream(self, context, method)
        with self._lock:
            if self._draining:
                raise NotReady(f"{self._name} is stopping: it takes no new Pull or Push "
                               "while those in flight finish (clients retry)")
            if len(self._open) >= self.max_streams:
                full = True
            else:
                full = False
                self._open.add(stream)
        if full:
            raise Overloaded(
                f"this server already carries {self.max_streams} Pull/Push streams, its "
                f"--max-streams limit; retry later, or start the server with a larger "
                f"--max-streams")
        return stream

    def _release(self, stream: Stream) -> None:
        with self._lock:
            self._open.discard(stream)
            if not self._open:
                self._idle.notify_all()

    def drain(self, timeout: float) -> bool:
        """Refuse new streams (UNAVAILABLE: clients retry) and block until the open ones
        have ended or `timeout` passes; True if none is open. A stopping server drains while
        its health says NOT_SERVING."""
        with self._idle:
            self._draining = True
            return self._idle.wait_for(lambda: not self._open, timeout)

    # ---- the watchdog -------------------------------------------------------------------

    def sweep(self) -> float | None:
        """Cancel every open stream whose wait on its peer passed its deadline. Returns the
        seconds until the next armed deadline, or None when no stream is waiting."""
        now = self._clock.monotonic()
        expired = []
        with self._lock:
            for stream in self._open:
                if stream.deadline <= now and not stream.cut:
                    stream.cut = True
                    expired.append(stream)
            upcoming = min((s.deadline for s in self._open if not s.cut), default=math.inf)
        for stream in expired:
            log.warning("cancelling %s from %s: its peer has been silent for %.1f s "
                        "(--stream-idle-timeout)", stream.method, stream.peer,
                        self.idle_timeout_s)
            stream._context.cancel()
        return None if upcoming == math.inf else max(0.0, upcoming - now)

    def start(self) -> None:
        if self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, name=f"{self._name}-stream-watchdog",
                                          daemon=True)
        self._watchdog.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5.0)

    def _watch(self) -> None:
        # A stream armed after a sweep has its deadline at least idle_timeout_s ahead, so
        # sleeping that long when nothing is armed never misses one by more than a sweep.
        while not self._stopping.is_set():
            try:
                wait = self.sweep()
            except Exception:  # never let the watchdog die: stalled streams would pile up
                log.exception("stream watchdog sweep failed")
                wait = None
            self._stopping.wait(self.idle_timeout_s if wait is None
                                else min(wait, self.idle_timeout_s))
