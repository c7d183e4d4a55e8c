"""UnaryPulls: a checked pull of whole shards is remembered under its request's bytes while
the store's placement stands, and its answer carries the values as they are when it is made."""

from __future__ import annotations

import threading

import numpy as np

from ps_common.shardmap import Component, Shard, VariableSpec
from ps_common.tensors import TensorMeta, decode_chunk, encode_chunk
from ps_proto.v1 import parameter_server_pb2 as pb
from ps_server import unary_pulls
from ps_server.store import ShardStore
from ps_server.unary_pulls import UnaryPulls

ROWS, COLS = 6, 4
SGD1 = Component.of({"name": "sgd", "lr": 1.0})
SPECS = {name: VariableSpec(name, (ROWS, COLS), initializer=Component.of(
    {"name": "constant", "value": value}), optimizer=SGD1)
    for name, value in (("a", 1.0), ("b", 2.0))}
SHARDS = [Shard("a", 0, 0, ROWS, "s"), Shard("b", 0, 0, ROWS, "s")]
REQUEST = b"a request's bytes"


def store_holding(epoch: int = 1) -> ShardStore:
    store = ShardStore()
    store.assign(epoch, SPECS, SHARDS)
    return store


def checked(store: ShardStore, names=("a", "b"), wire=None, row_ids=None):
    return store.check_pull(store.epoch, [(n, 0) for n in names], wire, row_ids)


def push(store: ShardStore, name: str, value: float) -> None:
    targets = store.plan_push(store.epoch, [(name, 0)], [TensorMeta("float32", (ROWS, COLS))])
    store.apply(targets, [np.full((ROWS, COLS), value, np.float32)])


def answered(message: bytes, dtype="float32") -> tuple[pb.PullHeader, np.ndarray]:
    chunk = decode_chunk(message)
    return pb.PullHeader.FromString(chunk.header), np.frombuffer(chunk.data, dtype)


def test_a_remembered_pull_is_found_by_its_bytes_and_answers_the_current_values():
    store = store_holding()
    pulls = UnaryPulls(store)
    assert pulls.find(REQUEST) is None
    remembered = pulls.remember(REQUEST, store.placement_version, checked(store))
    assert pulls.find(REQUEST) is remembered
    assert pulls.find(b"other bytes") is None
    push(store, "b", 0.5)  # after it was remembered: the answer has it
    header, values = answered(remembered.answer())
    assert [(t.shape, t.dtype) for t in header.tensors] == [
        (t.shape, t.dtype) for t in (TensorMeta("float32", (ROWS, COLS)).to_proto(),) * 2]
    np.testing.assert_array_equal(values[:ROWS * COLS], 1.0)
    np.testing.assert_array_equal(values[ROWS * COLS:], 1.5)


def test_a_view_is_found_by_its_own_bytes_without_hashing_the_message_it_views():
    # PushThenPull's pull is a view of the message that also carries the push. Hashing a
    # memoryview hashes the object it views first (a fresh message: every byte of it), and
    # an unhashable object makes that raise: a view of a bytearray shows which is done.
    store = store_holding()
    pulls = UnaryPulls(store)
    remembered = pulls.remember(REQUEST, store.placement_version, checked(store))
    message = bytearray(b"a push's bytes, then " + REQUEST)
    assert pulls.find(memoryview(message).toreadonly()[-len(REQUEST):]) is remembered
    assert pulls.find(memoryview(message).toreadonly()[:len(REQUEST)]) is None


def test_an_answer_is_the_message_the_general_path_builds():
    store = store_holding()
    reads = checked(store)
    remembered = UnaryPulls(store).remember(REQUEST, store.placement_version, reads)
    header = pb.PullHeader(tensors=[read.meta.to_proto() for read in reads])
    attached = b"\x08\x01"
    general = encode_chunk(header.SerializeToString(),
                           [read.held.values.tobytes() for read in reads], attached)
    assert remembered.answer(attached) == general
    assert remembered.answer() == encode_chunk(
        header.SerializeToString(), [read.held.values.tobytes() for read in reads])


def test_a_narrowed_pull_converts_the_values_of_each_answer():
    store = store_holding()
    remembered = UnaryPulls(store).remember(
        REQUEST, store.placement_version, checked(store, ("a",), "float16"))
    np.testing.assert_array_equal(answered(remembered.answer(), "float16")[1], 1.0)
    push(store, "a", 0.25)
    np.testing.assert_array_equal(answered(remembered.answer(), "float16")[1], 0.75)


def test_nothing_is_found_once_the_placement_changed():
    store = store_holding()
    pulls = UnaryPulls(store)
    pulls.remember(REQUEST, store.placement_version, checked(store))
    store.assign(store.epoch + 1, SPECS, SHARDS)  # same shards, a new epoch
    assert pulls.find(REQUEST) is None


def test_a_pull_checked_before_the_placement_changed_is_not_remembered():
    store = store_holding()
    version = store.placement_version
    reads = checked(store)
    store.assign(store.epoch + 1, SPECS, SHARDS)
    pulls = UnaryPulls(store)
    assert pulls.remember(REQUEST, version, reads) is None
    assert pulls.find(REQUEST) is None


def test_a_row_pull_is_not_remembered():
    spec = VariableSpec("t", (ROWS, COLS), initializer=Component.of("zeros"), optimizer=SGD1,
                        kind="embedding")
    store = ShardStore()
    store.assign(1, {"t": spec}, [Shard("t", 0, 0, ROWS, "s")])
    pulls = UnaryPulls(store)
    reads = store.check_pull(1, [("t", 0)], None, [np.array([1, 3], np.int64)])
    assert pulls.remember(REQUEST, store.placement_version, reads) is None
    assert pulls.find(REQUEST) is None


def test_forget_drops_everything():
    store = store_holding()
    pulls = UnaryPulls(store)
    pulls.remember(REQUEST, store.placement_version, checked(store))
    pulls.forget()
    assert pulls.find(REQUEST) is None


def test_at_most_max_remembered_are_kept(monkeypatch):
    monkeypatch.setattr(unary_pulls, "MAX_REMEMBERED", 3)
    store = store_holding()
    pulls = UnaryPulls(store)
    for i in range(4):
        pulls.remember(b"%d" % i, store.placement_version, checked(store))
    assert [pulls.find(b"%d" % i) is not None for i in range(4)] == [False] * 3 + [True]


class WatchedLock:
    """A lock that says when someone has started to wait for it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.wanted = threading.Event()

    def acquire(self):
        self.wanted.set()
        return self._lock.acquire()

    def release(self):
        self._lock.release()


def test_an_answer_waits_for_an_update_holding_a_shards_lock():
    """The answer is read under the shards' locks, as pushes take them: never half a push."""
    store = store_holding()
    (held,) = store.lookup([("a", 0)])
    held.lock = lock = WatchedLock()
    remembered = UnaryPulls(store).remember(REQUEST, store.placement_version,
                                            checked(store, ("a",)))
    answers = []
    lock.acquire()
    lock.wanted.clear()
    reader = threading.Thread(target=lambda: answers.append(remembered.answer()))
    reader.start()
    try:
        assert lock.wanted.wait(30), "the answer never asked for the shard's lock"
        held.values[:] = 5.0  # the rest of "an update" while the reader waits
        assert not answers
    finally:
        lock.release()
        reader.join(30)
    assert not reader.is_alive()
    np.testing.assert_array_equal(answered(answers[0])[1], 5.0)


def test_a_long_request_is_not_remembered(monkeypatch):
    store = store_holding()
    pulls = UnaryPulls(store)
    pulls.remember(b"123456789", store.placement_version, checked(store))
    monkeypatch.setattr(unary_pulls, "MAX_REQUEST_BYTES", 8)
    assert pulls.find(b"123456789") is None  # not even looked up
    assert pulls.remember(b"123456789", store.placement_version, checked(store)) is None
    assert pulls.remember(b"12345678", store.placement_version, checked(store)) is not None
    assert pulls.find(b"12345678") is not None


def test_a_view_of_a_request_is_found_and_remembered_as_bytes():
    """PushThenPull's pull is a view into its whole message: it is looked up as it is, and
    remembered as bytes of its own (a view would keep the message, push and all, alive)."""
    store = store_holding()
    pulls = UnaryPulls(store)
    message = b"push bytes" + REQUEST
    view = memoryview(message)[len(b"push bytes"):]
    remembered = pulls.remember(view, store.placement_version, checked(store))
    (key,) = pulls._remembered
    assert type(key) is bytes and key == REQUEST
    assert pulls.find(REQUEST) is remembered
    assert pulls.find(memoryview(b"..." + REQUEST)[3:]) is remembered
