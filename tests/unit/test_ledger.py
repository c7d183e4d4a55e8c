"""PushLedger: exactly-once application of (client, incarnation, sequence) pushes."""

from __future__ import annotations

import threading

import pytest

from ps_common.errors import FencedIncarnation, ResourceExhausted
from ps_server.ledger import PushLedger


def attempt(ledger: PushLedger, client: str, inc: int, seq: int, acked: int = 0) -> bool:
    """One push that succeeds if applied; returns whether the ledger called it a duplicate."""
    with ledger.exactly_once(client, inc, seq, acked) as duplicate:
        return duplicate


class Boom(Exception):
    pass


def test_first_apply_is_new_and_the_retry_is_a_duplicate():
    ledger = PushLedger()
    assert attempt(ledger, "w1", 1, 1) is False
    assert attempt(ledger, "w1", 1, 1) is True
    assert attempt(ledger, "w1", 1, 2) is False
    assert attempt(ledger, "w1", 1, 2) is True
    assert attempt(ledger, "w1", 1, 1) is True


def test_clients_are_independent():
    ledger = PushLedger()
    assert attempt(ledger, "w1", 1, 1) is False
    assert attempt(ledger, "w2", 1, 1) is False
    assert attempt(ledger, "w2", 1, 1) is True


def test_exception_in_block_means_not_applied():
    ledger = PushLedger()
    with pytest.raises(Boom):
        with ledger.exactly_once("w1", 1, 1, 0) as duplicate:
            assert duplicate is False
            raise Boom()
    assert attempt(ledger, "w1", 1, 1) is False  # retried: applied now
    assert attempt(ledger, "w1", 1, 1) is True


def test_exception_on_a_gap_sequence_is_not_remembered():
    ledger = PushLedger()
    assert attempt(ledger, "w1", 1, 1) is False
    with pytest.raises(Boom):
        with ledger.exactly_once("w1", 1, 3, 0):
            raise Boom()
    assert ledger.pending("w1") == 0
    assert attempt(ledger, "w1", 1, 3) is False


def test_older_incarnation_is_fenced():
    ledger = PushLedger()
    assert attempt(ledger, "w1", 2, 1) is False
    with pytest.raises(FencedIncarnation) as info:
        attempt(ledger, "w1", 1, 7)
    assert info.value.code == "FAILED_PRECONDITION"
    assert "w1" in info.value.message
    # a fenced attempt changes nothing for the current incarnation
    assert attempt(ledger, "w1", 2, 1) is True
    assert attempt(ledger, "w1", 2, 2) is False


def test_newer_incarnation_resets_sequences():
    ledger = PushLedger()
    for seq in (1, 2, 3, 5):
        assert attempt(ledger, "w1", 1, seq) is False
    assert ledger.pending("w1") == 1  # 5 is above the contiguous floor 3
    assert attempt(ledger, "w1", 2, 1) is False  # a new incarnation starts over
    assert ledger.pending("w1") == 0
    assert attempt(ledger, "w1", 2, 1) is True
    assert attempt(ledger, "w1", 2, 3) is False
    with pytest.raises(FencedIncarnation):
        attempt(ledger, "w1", 1, 6)


def test_out_of_order_sequences():
    ledger = PushLedger()
    order = [3, 1, 5, 2, 4, 7]
    for seq in order:
        assert attempt(ledger, "w1", 1, seq) is False, seq
    for seq in order:
        assert attempt(ledger, "w1", 1, seq) is True, seq
    assert attempt(ledger, "w1", 1, 6) is False
    assert attempt(ledger, "w1", 1, 8) is False


def test_acked_through_shrinks_pending():
    ledger = PushLedger()
    for seq in (2, 4, 6, 8):
        assert attempt(ledger, "w1", 1, seq) is False
    assert ledger.pending("w1") == 4
    assert attempt(ledger, "w1", 1, 9, acked=4) is False
    assert ledger.pending("w1") == 3  # 6, 8, 9 remain above the floor 4
    assert attempt(ledger, "w1", 1, 12, acked=9) is False
    assert ledger.pending("w1") == 1  # 12 only
    assert attempt(ledger, "w1", 1, 12, acked=12) is True
    assert ledger.pending("w1") == 0
    # everything at or below the acknowledged floor counts as applied
    for seq in range(1, 13):
        assert attempt(ledger, "w1", 1, seq, acked=12) is True
    assert attempt(ledger, "w1", 1, 13, acked=12) is False


def test_acked_through_is_monotonic():
    ledger = PushLedger()
    attempt(ledger, "w1", 1, 6, acked=5)
    attempt(ledger, "w1", 1, 8, acked=2)  # an older ack does not lower the floor
    assert attempt(ledger, "w1", 1, 4) is True
    assert attempt(ledger, "w1", 1, 7) is False


def test_unknown_client_has_nothing_pending():
    assert PushLedger().pending("nobody") == 0


def test_max_pending_refuses_to_run_further_ahead_instead_of_guessing():
    from ps_common.errors import ResourceExhausted

    ledger = PushLedger(max_pending=6)
    for seq in (2, 4, 6):  # sequence 1 is still on its way (e.g. retrying)
        assert attempt(ledger, "w1", 1, seq) is False
    with pytest.raises(ResourceExhausted):
        attempt(ledger, "w1", 1, 7)  # more than 6 above the floor (0)
    assert ledger.pending("w1") == 3
    # The late sequence is still applied, never mistaken for a duplicate...
    assert attempt(ledger, "w1", 1, 1) is False
    # ...and nothing already applied is applied again.
    for seq in (1, 2, 4, 6):
        assert attempt(ledger, "w1", 1, seq) is True, seq
    # Once the client acknowledges, it may go on.
    with ledger.exactly_once("w1", 1, 12, acked_through=6) as duplicate:
        assert duplicate is False
    assert ledger.pending("w1") == 1


def test_a_full_ledger_refuses_new_clients_and_never_forgets_a_live_one():
    # Regression: an LRU bound evicted a client after 4,096 others pushed, and a retry of
    # its already-applied push was then applied a second time.
    ledger = PushLedger(max_clients=2)
    assert attempt(ledger, "a", 1, 1) is False
    assert attempt(ledger, "b", 1, 1) is False
    with pytest.raises(ResourceExhausted):
        attempt(ledger, "c", 1, 1)
    assert attempt(ledger, "a", 1, 1) is True  # a's retry is still recognised
    assert ledger.live_clients() == 2


def test_retired_clients_make_room_and_stay_fenced():
    ledger = PushLedger(max_clients=2)
    attempt(ledger, "a", 1, 1)
    attempt(ledger, "b", 1, 1)
    ledger.retire("b", 1)
    assert attempt(ledger, "c", 1, 1) is False
    with pytest.raises(FencedIncarnation):  # a late push of the retired incarnation
        attempt(ledger, "b", 1, 2)
    ledger.retire("c", 1)
    assert attempt(ledger, "b", 2, 1) is False  # a newer incarnation of b is a new client


def test_retiring_an_older_incarnation_leaves_the_live_one_alone():
    ledger = PushLedger()
    attempt(ledger, "a", 2, 1)
    ledger.retire("a", 1)
    assert attempt(ledger, "a", 2, 1) is True
    assert ledger.live_clients() == 1


def test_fences_are_bounded_oldest_first():
    ledger = PushLedger(max_clients=2)
    for name in "xyz":
        attempt(ledger, name, 1, 1)
        ledger.retire(name, 1)
    assert attempt(ledger, "x", 1, 2) is False  # x's fence was the oldest: forgotten
    with pytest.raises(FencedIncarnation):
        attempt(ledger, "z", 1, 2)


def _run_threads(target, n: int) -> None:
    threads = [threading.Thread(target=target, args=(i,), name=f"ledger-test-{i}")
               for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


def test_concurrent_same_sequence_applied_exactly_once():
    ledger = PushLedger()
    n = 16
    barrier = threading.Barrier(n, timeout=10)
    results: list[bool] = []
    inside = [0]
    max_inside = [0]
    lock = threading.Lock()

    def worker(_):
        barrier.wait()
        with ledger.exactly_once("w1", 1, 42, 0) as duplicate:
            with lock:
                inside[0] += 1
                max_inside[0] = max(max_inside[0], inside[0])
            with lock:
                inside[0] -= 1
            results.append(duplicate)

    _run_threads(worker, n)
    assert len(results) == n
    assert results.count(False) == 1
    assert max_inside[0] == 1  # one client's pushes are applied one at a time


def test_concurrent_first_attempt_fails_then_exactly_one_other_applies():
    ledger = PushLedger()
    n = 8
    barrier = threading.Barrier(n, timeout=10)
    outcomes: list[str] = []
    failed_once = threading.Event()

    def worker(_):
        barrier.wait()
        try:
            with ledger.exactly_once("w1", 1, 1, 0) as duplicate:
                if not duplicate and not failed_once.is_set():
                    failed_once.set()
                    raise Boom()
                outcomes.append("dup" if duplicate else "applied")
        except Boom:
            outcomes.append("failed")

    _run_threads(worker, n)
    assert outcomes.count("failed") == 1
    assert outcomes.count("applied") == 1
    assert outcomes.count("dup") == n - 2


def test_concurrent_distinct_sequences_each_applied_once():
    ledger = PushLedger(max_pending=8)
    n, per = 8, 50
    barrier = threading.Barrier(n, timeout=10)
    applied: list[int] = []
    lock = threading.Lock()

    def worker(i):
        barrier.wait()
        # every thread tries every sequence: each must be applied by exactly one of them
        for seq in range(1, per + 1):
            with ledger.exactly_once("w1", 1, seq, 0) as duplicate:
                if not duplicate:
                    with lock:
                        applied.append(seq)

    _run_threads(worker, n)
    assert sorted(applied) == list(range(1, per + 1))


def test_a_newer_incarnation_waiting_on_a_retiring_one_is_not_fenced():
    # Regression: retire() marked the record while a newer incarnation's push waited for
    # its lock, and that push was refused as fenced.
    ledger = PushLedger()
    attempt(ledger, "w", 1, 1)
    in_push, retire_started = threading.Event(), threading.Event()
    outcome = []

    def old_push():
        with ledger.exactly_once("w", 1, 2, 0):
            in_push.set()
            retire_started.wait(10)

    def newer_push():
        outcome.append(attempt(ledger, "w", 2, 1))

    old = threading.Thread(target=old_push, name="old-push")
    old.start()
    assert in_push.wait(10)
    retiring = threading.Thread(target=ledger.retire, args=("w", 1), name="retire")
    retiring.start()
    newer = threading.Thread(target=newer_push, name="newer-push")
    newer.start()
    retire_started.set()
    for t in (old, retiring, newer):
        t.join(10)
    assert outcome == [False]
    with pytest.raises(FencedIncarnation):
        attempt(ledger, "w", 1, 3)


def test_counts_applied_and_duplicate_pushes_and_keeps_them_past_retirement():
    ledger = PushLedger()
    assert attempt(ledger, "w1", 1, 1) is False
    assert attempt(ledger, "w1", 1, 1) is True
    assert ledger.applied("w1", 1, 1)  # a retry found applied before it was read: counted
    assert attempt(ledger, "w2", 1, 1) is False
    with pytest.raises(Boom):  # not applied: not counted
        with ledger.exactly_once("w2", 1, 2, 0):
            raise Boom()
    assert ledger.counts() == (2, 2)
    ledger.retire("w1", 1)
    assert ledger.counts() == (2, 2)  # what retired clients did still counts
    assert attempt(ledger, "w1", 2, 1) is False  # a new incarnation
    assert ledger.counts() == (3, 2)


def test_a_checkpoint_restored_after_the_client_pushed_here_keeps_both_records():
    """A restore can arrive after the same incarnation pushed to this server's other shards
    (a restore retried after a passing failure): both what it holds and what came since
    count as applied."""
    ledger = PushLedger()
    with ledger.exactly_once("c", 1, 3, 0) as duplicate:
        assert not duplicate
    ledger.restore({"clients": {"c": [1, 1, [2]]}, "fences": {}})  # 1 and 2 in the checkpoint
    assert all(ledger.applied("c", 1, s) for s in (1, 2, 3))
    assert not ledger.applied("c", 1, 4)
    ledger.restore({"clients": {"c": [0, 9, []]}, "fences": {}})  # an older incarnation's
    assert not ledger.applied("c", 1, 4)


def test_a_restore_that_merges_takes_the_record_lock_without_the_table_lock():
    """Locks go a record's, then the table's (retire() takes them so): a restore that
    merges into a known record must not hold the table's lock while it waits for the
    record's, or the two deadlock."""
    ledger = PushLedger()
    with ledger.exactly_once("c", 1, 3, 0):
        pass
    record = ledger._clients["c"]
    held_table_lock = []

    class Spy:
        def __init__(self, lock):
            self._lock = lock

        def __enter__(self):
            held_table_lock.append(ledger._lock.locked())
            return self._lock.__enter__()

        def __exit__(self, *exc):
            return self._lock.__exit__(*exc)

    record.lock = Spy(record.lock)
    ledger.restore({"clients": {"c": [1, 1, [2]]}, "fences": {}})
    assert held_table_lock == [False]
    assert all(ledger.applied("c", 1, s) for s in (1, 2, 3))


def test_check_live_refuses_what_a_push_would_be_refused_for_in_the_same_words():
    ledger = PushLedger()
    ledger.check_live("new", 1)  # never seen: live
    attempt(ledger, "a", 2, 1)
    ledger.check_live("a", 2)
    ledger.retire("b", 3)
    for client, inc in (("a", 1), ("b", 3), ("b", 2)):
        with pytest.raises(FencedIncarnation) as by_check:
            ledger.check_live(client, inc)
        with pytest.raises(FencedIncarnation) as by_push:
            attempt(ledger, client, inc, 1)
        assert by_check.value.message == by_push.value.message
    ledger.check_live("b", 4)  # a newer incarnation of a retired client
