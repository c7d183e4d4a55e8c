"""Retry policy (with a fake clock), status <-> exception translation, CLI size parsing."""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
from concurrent import futures

import grpc
import pytest

from ps_common.cli import parse_bytes, run_until_signal
from ps_common.clock import FakeClock
from ps_common.errors import (
    FencedIncarnation, InvalidArgument, NonFiniteGradient, NotReady, StaleEpoch, StepTimeout,
    UnknownVariable,
)
from ps_common.rpc import READ_RETRY_CODES, RetryPolicy, call_with_retry
from ps_common.status import RemoteError, translate_errors


class RecordingClock(FakeClock):
    def __init__(self):
        super().__init__()
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        super().sleep(seconds)


class Failing:
    """A callable that raises the given codes in turn, then returns 'ok'."""

    def __init__(self, *codes: grpc.StatusCode):
        self.codes = list(codes)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        if self.codes:
            raise RemoteError(self.codes.pop(0), "m")
        return "ok"


class FakeRpcError(grpc.RpcError):
    """What a failed unary call raises: an RpcError that is also a grpc.Call."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing=()):
        self._code, self._details, self._trailing = code, details, tuple(trailing)

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


U = grpc.StatusCode.UNAVAILABLE


def bounds(policy: RetryPolicy, sleeps: int) -> tuple[float, float]:
    bases = [min(policy.max_backoff_s, policy.initial_backoff_s * policy.multiplier**i)
             for i in range(sleeps)]
    return sum(b * (1 - policy.jitter) for b in bases), sum(bases)


def test_retries_unavailable_until_max_attempts_then_raises():
    clock = RecordingClock()
    policy = RetryPolicy(max_attempts=5)
    call = Failing(*[U] * 10)
    with pytest.raises(RemoteError) as info:
        call_with_retry(call, target="s0", policy=policy, clock=clock, rng=random.Random(1))
    assert info.value.code() == U
    assert call.calls == 5
    assert len(clock.sleeps) == 4


def test_succeeds_after_transient_failures():
    clock = RecordingClock()
    call = Failing(U, U)
    assert call_with_retry(call, target="s0", policy=RetryPolicy(), clock=clock) == "ok"
    assert call.calls == 3 and len(clock.sleeps) == 2


@pytest.mark.parametrize("code", [
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
])
def test_other_codes_are_not_retried_by_default(code):
    clock = RecordingClock()
    call = Failing(code)
    with pytest.raises(RemoteError) as info:
        call_with_retry(call, target="s0", policy=RetryPolicy(), clock=clock)
    assert info.value.code() == code
    assert call.calls == 1 and clock.sleeps == []


def test_backoff_grows_and_is_bounded():
    policy = RetryPolicy(max_attempts=12, initial_backoff_s=0.1, max_backoff_s=1.0,
                         multiplier=2.0, jitter=0.5)
    for seed in range(20):
        clock = RecordingClock()
        start = clock.monotonic()
        with pytest.raises(RemoteError):
            call_with_retry(Failing(*[U] * 20), target="s", policy=policy, clock=clock,
                            rng=random.Random(seed))
        assert len(clock.sleeps) == 11
        assert all(0 < s <= policy.max_backoff_s for s in clock.sleeps)
        for i, s in enumerate(clock.sleeps):
            base = min(policy.max_backoff_s, policy.initial_backoff_s * 2**i)
            assert base * (1 - policy.jitter) <= s <= base
        low, high = bounds(policy, 11)
        assert low <= clock.monotonic() - start <= high + 1e-9
        assert clock.monotonic() - start == pytest.approx(sum(clock.sleeps))


def test_backoff_without_jitter_is_exact():
    policy = RetryPolicy(max_attempts=6, initial_backoff_s=0.05, max_backoff_s=0.3,
                         multiplier=2.0, jitter=0.0)
    clock = RecordingClock()
    with pytest.raises(RemoteError):
        call_with_retry(Failing(*[U] * 10), target="s", policy=policy, clock=clock)
    assert clock.sleeps == pytest.approx([0.05, 0.1, 0.2, 0.3, 0.3])


def test_default_policy_total_wait_is_bounded():
    policy = RetryPolicy()
    clock = RecordingClock()
    with pytest.raises(RemoteError):
        call_with_retry(Failing(*[U] * 100), target="s", policy=policy, clock=clock)
    assert len(clock.sleeps) == policy.max_attempts - 1
    low, high = bounds(policy, policy.max_attempts - 1)
    assert low <= sum(clock.sleeps) <= high + 1e-9


def test_read_retry_codes_retry_deadline_exceeded():
    assert READ_RETRY_CODES == {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
    policy = RetryPolicy(retry_codes=READ_RETRY_CODES)
    clock = RecordingClock()
    call = Failing(grpc.StatusCode.DEADLINE_EXCEEDED, U, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert call_with_retry(call, target="s", policy=policy, clock=clock) == "ok"
    assert call.calls == 4
    call = Failing(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(RemoteError) as info:
        call_with_retry(call, target="s", policy=policy, clock=clock)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert call.calls == 2


def test_grpc_rpc_errors_are_translated_and_retried():
    clock = RecordingClock()
    errors = [FakeRpcError(U, "down"), FakeRpcError(grpc.StatusCode.NOT_FOUND, "no such var")]

    def call():
        raise errors.pop(0)

    with pytest.raises(RemoteError) as info:
        call_with_retry(call, target="10.0.0.1:7000", policy=RetryPolicy(), clock=clock)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "no such var"
    assert info.value.target == "10.0.0.1:7000"
    assert info.value.stale_epoch is None
    assert len(clock.sleeps) == 1


def test_max_attempts_one_means_no_retry():
    clock = RecordingClock()
    call = Failing(U)
    with pytest.raises(RemoteError):
        call_with_retry(call, target="s", policy=RetryPolicy(max_attempts=1), clock=clock)
    assert call.calls == 1 and clock.sleeps == []


def test_non_rpc_exceptions_propagate_untouched():
    def call():
        raise KeyError("bug")

    with pytest.raises(KeyError):
        call_with_retry(call, target="s", policy=RetryPolicy(), clock=RecordingClock())


def test_on_retry_sees_each_failure_before_its_wait_and_may_end_the_retries():
    seen = []
    call_with_retry(Failing(U, U), target="s", policy=RetryPolicy(), clock=RecordingClock(),
                    on_retry=lambda attempt, error: seen.append((attempt, error.code())))
    assert seen == [(1, U), (2, U)]

    class GiveUp(Exception):
        pass

    def give_up(attempt, error):
        raise GiveUp

    call = Failing(U, U)
    with pytest.raises(GiveUp):
        call_with_retry(call, target="s", policy=RetryPolicy(), clock=RecordingClock(),
                        on_retry=give_up)
    assert call.calls == 1


def test_a_set_stop_event_ends_the_retries_with_cancelled():
    stop = threading.Event()
    stop.set()
    call = Failing()
    with pytest.raises(RemoteError) as info:
        call_with_retry(call, target="s0", policy=RetryPolicy(), stop=stop)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert info.value.target == "s0"
    assert call.calls == 0  # no attempt starts once it is set


def test_stop_ends_a_backoff_wait_at_once():
    """An unlimited policy whose backoff is an hour: only the stop event ends the wait."""
    stop, waiting = threading.Event(), threading.Event()
    policy = RetryPolicy(max_attempts=None, initial_backoff_s=3600, max_backoff_s=3600)
    call = Failing(*[U] * 10)
    with futures.ThreadPoolExecutor(1, thread_name_prefix="test-retry") as pool:
        result = pool.submit(call_with_retry, call, target="s", policy=policy, stop=stop,
                             on_retry=lambda attempt, error: waiting.set())
        assert waiting.wait(10)
        stop.set()
        with pytest.raises(RemoteError) as info:
            result.result(timeout=10)
    assert info.value.code() == grpc.StatusCode.CANCELLED
    assert call.calls == 1


def test_unlimited_policy_retries_until_success_and_needs_a_stop_event():
    policy = RetryPolicy(max_attempts=None, initial_backoff_s=0.0, max_backoff_s=0.0)
    call = Failing(*[U] * 200)
    assert call_with_retry(call, target="s", policy=policy, stop=threading.Event()) == "ok"
    assert call.calls == 201
    with pytest.raises(ValueError):
        call_with_retry(Failing(), target="s", policy=policy)


def test_backoff_of_very_late_attempts_stays_at_its_maximum():
    policy = RetryPolicy(max_attempts=None, initial_backoff_s=0.05, max_backoff_s=2.0,
                         jitter=0.0)
    assert policy.backoff(5000, random.Random(0)) == 2.0


# ---- status translation -------------------------------------------------------------------

class AbortCalled(Exception):
    pass


class FakeContext:
    """Just enough of grpc.ServicerContext for translate_errors."""

    def __init__(self):
        self._code = None
        self.aborted_with = None
        self.status = None

    def code(self):
        return self._code

    def abort_with_status(self, status):
        self._code = status.code
        self.status = status
        self.aborted_with = (status.code, status.details)
        raise AbortCalled()

    def abort(self, code, details):
        self._code = code
        self.aborted_with = (code, details)
        raise AbortCalled()


@pytest.mark.parametrize("error, code", [
    (InvalidArgument("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownVariable("who"), grpc.StatusCode.NOT_FOUND),
    (NotReady("later"), grpc.StatusCode.UNAVAILABLE),
    (StaleEpoch(3, 5), grpc.StatusCode.ABORTED),
])
def test_catalog_errors_round_trip_through_status_and_remote_error(error, code):
    ctx = FakeContext()
    with pytest.raises(AbortCalled):
        with translate_errors(ctx, "Push"):
            raise error
    status = ctx.status
    assert status.code == code
    assert status.details == error.message
    remote = RemoteError.from_rpc_error(
        FakeRpcError(status.code, status.details, status.trailing_metadata), target="t")
    assert remote.code() == code
    assert remote.target == "t"
    if isinstance(error, StaleEpoch):
        assert (remote.stale_epoch.request_epoch, remote.stale_epoch.current_epoch) == (3, 5)
    else:
        assert remote.stale_epoch is None


def test_translate_errors_maps_catalog_errors_to_their_codes():
    ctx = FakeContext()
    with pytest.raises(AbortCalled):
        with translate_errors(ctx, "Push"):
            raise UnknownVariable("variable 'x' is unknown")
    assert ctx.aborted_with[0] == grpc.StatusCode.NOT_FOUND


def test_translate_errors_hides_unexpected_errors_as_internal(caplog):
    ctx = FakeContext()
    with pytest.raises(AbortCalled):
        with translate_errors(ctx, "Pull"):
            raise RuntimeError("secret-internal-detail")
    code, details = ctx.aborted_with
    assert code == grpc.StatusCode.INTERNAL
    assert "secret-internal-detail" not in details


def test_translate_errors_passes_success_through():
    ctx = FakeContext()
    with translate_errors(ctx, "Pull"):
        pass
    assert ctx.aborted_with is None


# ---- parse_bytes ------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("4096", 4096),
    ("0", 0),
    ("64MiB", 64 * 1024**2),
    ("64mib", 64 * 1024**2),
    ("64Mi", 64 * 1024**2),
    ("2GB", 2 * 1000**3),
    ("2G", 2 * 1000**3),
    ("1.5GB", 1_500_000_000),
    ("1.5GiB", 3 * 1024**3 // 2),
    ("10k", 10_000),
    ("10KiB", 10 * 1024),
    ("3TiB", 3 * 1024**4),
    ("512B", 512),
    ("512b", 512),
    (" 8 MiB ", 8 * 1024**2),
])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-5", "5XB", "1.2.3", "MiB", "64 MiBs", "1e9",
                                  "0x10", "5 PB"])
def test_parse_bytes_rejects_bad_input(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


def test_parse_bytes_works_as_an_argparse_type():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-budget", type=parse_bytes, default=0)
    assert parser.parse_args(["--memory-budget", "1GiB"]).memory_budget == 1024**3


def test_parse_bytes_decimal_sizes_are_exact():
    assert parse_bytes("1.005KB") == 1005


# ---- running a daemon until a signal ----------------------------------------------------------

def test_a_signal_nested_in_the_handler_of_another_does_not_deadlock(monkeypatch):
    """A Python signal handler can run again while its first run is under way (a dying
    multi-threaded parent sends PR_SET_PDEATHSIG once per thread): the second run must not
    wait for a lock the first one holds. Simulated: the second run starts right after the
    first run's first C call returns (e.g. a lock's acquire)."""
    handlers = {}
    monkeypatch.setattr(signal, "signal", lambda signum, handler: handlers.setdefault(
        signum, handler))
    both_ran = threading.Event()

    def deliver_twice():
        handler = handlers[signal.SIGTERM]
        nested = []

        def profile(frame, event, arg):
            if event == "c_return" and not nested:
                nested.append(True)
                handler(signal.SIGTERM, None)

        sys.setprofile(profile)  # this thread only
        try:
            handler(signal.SIGTERM, None)
        finally:
            sys.setprofile(None)
        both_ran.set()

    stopped = []

    def wait(timeout):
        # daemon: on a handler that deadlocks, the test fails instead of hanging
        threading.Thread(target=deliver_twice, name="test-signals", daemon=True).start()
        assert both_ran.wait(10), "the nested handler deadlocked"
        return False

    assert run_until_signal(lambda: stopped.append(True), wait, lambda: None) == 0
    assert stopped == [True]



# ---- a child of ps-cluster ------------------------------------------------------------------

DIE_WITH_PROBE = """
import ctypes, os, signal
from ps_common.cli import DIE_WITH_ENV, die_with_parent
die_with_parent()
death = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(death), 0, 0, 0)  # PR_GET_PDEATHSIG
print(death.value == signal.SIGTERM, DIE_WITH_ENV in os.environ)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_of_ps_cluster_asks_for_sigterm_when_it_dies_or_does_not_start():
    import os
    import subprocess

    from ps_common.cli import DIE_WITH_ENV

    def probe(parent: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", DIE_WITH_PROBE], capture_output=True,
                              text=True, timeout=60, env={**os.environ, DIE_WITH_ENV: str(parent)})

    ours = probe(os.getpid())  # this process is the child's parent, as ps-cluster would be
    assert (ours.returncode, ours.stdout.split()) == (0, ["True", "False"]), ours.stderr
    orphan = probe(os.getpid() + 10_000_000)  # a parent that is gone (no such pid)
    assert orphan.returncode == 1 and DIE_WITH_ENV in orphan.stderr
    assert "not starting" in orphan.stderr


@pytest.mark.parametrize("error, reason", [
    (NonFiniteGradient("w: NaN"), "NON_FINITE_GRADIENT"),
    (FencedIncarnation("c retired"), "FENCED_INCARNATION"),
    (StepTimeout("waited 30 s"), "STEP_TIMEOUT"),
    (InvalidArgument("bad shape"), ""),
])
def test_an_errors_reason_reaches_the_client_as_error_info(error, reason):
    """A cause a client acts on (a diverged model, a fence, a step waited out) travels as a
    google.rpc.ErrorInfo of paramserve's domain, not in the message's words."""
    from ps_common.status import status_of

    remote = RemoteError.from_status(status_of(error), target="ps-0")
    assert remote.reason == reason and remote.code().name == error.code
    assert remote.details() == error.message
