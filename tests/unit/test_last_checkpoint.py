"""The job's last checkpoint has no next one to make up for it: it is tried again while it
fails (a server holding shards restarting as the job ends), within a bound."""

from __future__ import annotations

import threading

from ps_common.errors import CheckpointFailed
from ps_server.coordinator.checkpointer import take_last


class FailingFirst:
    """A checkpointer whose first `failures` takes fail as a server away makes them fail."""

    def __init__(self, failures: int):
        self.failures = failures
        self.takes = 0

    def take(self, reason: str):
        self.takes += 1
        if self.takes <= self.failures:
            raise CheckpointFailed("no checkpoint after 5 attempts: server ps-0 is away")
        return f"checkpoint ({reason})"


class Clock:
    """Time that moves only when the code under test waits (each retry's wait)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Stopping(threading.Event):
    """An event whose waits move `clock` instead of time (never set by them)."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock

    def wait(self, timeout=None):
        self.clock.now += timeout
        return self.is_set()


def test_the_last_checkpoint_is_tried_again_while_a_server_is_away():
    clock = Clock()
    checkpointer = FailingFirst(failures=3)
    taken = take_last(checkpointer, "end of the job", give_up_after_s=60.0,
                      stopping=Stopping(clock), retry_every_s=1.0, clock=clock)
    assert taken == "checkpoint (end of the job)" and checkpointer.takes == 4


def test_the_last_checkpoint_gives_up_after_its_bound_and_when_stopping(caplog):
    clock = Clock()
    checkpointer = FailingFirst(failures=1000)
    assert take_last(checkpointer, "end of the job", give_up_after_s=10.0,
                     stopping=Stopping(clock), retry_every_s=1.0, clock=clock) is None
    assert checkpointer.takes == 11  # at 0, 1, ..., 10 s
    assert "the end of the job checkpoint failed: no checkpoint after 5 attempts" in caplog.text

    stopping = Stopping(clock)
    stopping.set()
    checkpointer = FailingFirst(failures=1000)
    assert take_last(checkpointer, "end of the job", give_up_after_s=10.0,
                     stopping=stopping, retry_every_s=1.0, clock=clock) is None
    assert checkpointer.takes == 1
