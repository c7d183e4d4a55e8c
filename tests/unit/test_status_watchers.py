"""StatusWatchers: a coordinator whose job is over waits for the callers that watch its
status (ps-ctl status --watch) and read it lately, until each has read the outcome."""

from __future__ import annotations

from ps_common.clock import FakeClock
from ps_server.coordinator.status_watchers import RECENT_S, StatusWatchers


def test_a_recent_watcher_is_waited_for_until_it_reads_the_job_over():
    clock = FakeClock()
    watchers = StatusWatchers(clock)
    assert not watchers.waiting()  # nobody watches: nothing to wait for
    watchers.read("ipv4:127.0.0.1:5000", job_over=False)
    watchers.read("ipv4:127.0.0.1:5001", job_over=True)
    assert watchers.waiting()
    clock.advance(RECENT_S / 2)
    watchers.read("ipv4:127.0.0.1:5000", job_over=True)
    assert not watchers.waiting()


def test_a_watcher_silent_for_long_is_taken_to_be_gone():
    clock = FakeClock()
    watchers = StatusWatchers(clock)
    watchers.read("ipv4:127.0.0.1:5000", job_over=False)
    clock.advance(RECENT_S)
    assert not watchers.waiting()
