"""The per-call metrics (ps_common.telemetry) and the collectors' pull-time reads, without a
network: handlers are called the way gRPC calls them, through the interceptor, with a fake
servicer context."""

from __future__ import annotations

import tracemalloc
from types import SimpleNamespace

import grpc
import pytest
from prometheus_client import CollectorRegistry

from ps_common.auth import TokenCheck
from ps_common.errors import InvalidArgument
from ps_common.status import translate_errors
from ps_common.telemetry import OTHER_METHOD, PushSocketMetrics, RpcMetrics
from ps_server.coordinator.jobs import JobState
from ps_server.telemetry import CoordinatorCollector

PUSH = "/ps.v1.ParameterServer/PushUnary"
PULL = "/ps.v1.ParameterServer/Pull"


class Aborted(Exception):
    """What grpc's context.abort raises to unwind the handler."""


class FakeContext:
    """The parts of grpc.ServicerContext the interceptor and translate_errors use."""

    def __init__(self, metadata=()):
        self._code = None
        self._callbacks = []
        self._metadata = metadata

    def code(self):
        return self._code

    def abort(self, code, details):
        self._code = code
        raise Aborted(details)

    def abort_with_status(self, status):
        self.abort(status.code, status.details)

    def add_callback(self, callback) -> bool:
        self._callbacks.append(callback)
        return True

    def end(self) -> None:
        """The call is over (gRPC runs the callbacks then)."""
        for callback in self._callbacks:
            callback()


def details(method: str, metadata=()):
    return SimpleNamespace(method=method, invocation_metadata=metadata)


def intercepted(rpc: RpcMetrics, handler, method: str, *inner):
    """The handler gRPC would run for `method`, through `rpc` and then `inner` interceptors."""
    def through(index):
        def continuation(call_details):
            if index == len(inner):
                return handler
            return inner[index].intercept_service(through(index + 1), call_details)
        return continuation
    return rpc.intercept_service(through(0), details(method))


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def rpc(registry):
    return RpcMetrics(registry, [PUSH, PULL])


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def unary(behavior):
    return grpc.unary_unary_rpc_method_handler(
        behavior, request_deserializer=lambda raw: raw.decode(),
        response_serializer=lambda reply: reply.encode())


def call(handler, raw: bytes, context: FakeContext):
    """What gRPC does with a unary call: deserialize, run, serialize."""
    request = handler.request_deserializer(raw)
    try:
        reply = handler.unary_unary(request, context)
    except Aborted:
        return None
    return handler.response_serializer(reply)


def test_a_call_is_counted_with_its_code_latency_and_bytes(registry, rpc):
    handler = intercepted(rpc, unary(lambda request, context: request.upper()), PUSH)
    assert call(handler, b"abc", FakeContext()) == b"ABC"
    assert call(handler, b"de", FakeContext()) == b"DE"
    assert value(registry, "paramserve_rpc_handled_total", method=PUSH, code="OK") == 2
    assert value(registry, "paramserve_rpc_handling_seconds_count", method=PUSH) == 2
    assert value(registry, "paramserve_rpc_received_bytes_total", method=PUSH) == 5
    assert value(registry, "paramserve_rpc_sent_bytes_total", method=PUSH) == 5
    assert value(registry, "paramserve_rpc_in_flight", method=PUSH) == 0


def test_a_refused_push_is_counted_under_its_status_code(registry, rpc):
    def push(request, context):
        with translate_errors(context, "PushUnary"):
            raise InvalidArgument("gradient of shape (5,) for a variable of shape (4,)")

    handler = intercepted(rpc, unary(push), PUSH)
    assert call(handler, b"grad", FakeContext()) is None
    assert value(registry, "paramserve_rpc_handled_total", method=PUSH,
                 code="INVALID_ARGUMENT") == 1
    assert value(registry, "paramserve_rpc_handled_total", method=PUSH, code="OK") == 0
    assert value(registry, "paramserve_rpc_in_flight", method=PUSH) == 0


def test_an_exception_no_handler_caught_counts_as_unknown(registry, rpc):
    def broken(request, context):
        raise RuntimeError("bug")

    handler = intercepted(rpc, unary(broken), PUSH)
    with pytest.raises(RuntimeError):
        handler.unary_unary("x", FakeContext())
    assert value(registry, "paramserve_rpc_handled_total", method=PUSH, code="UNKNOWN") == 1


def test_calls_refused_for_want_of_the_token_are_counted_and_reach_nothing(registry, rpc):
    reached = []
    handler = unary(lambda request, context: reached.append(request) or "ok")
    refused = intercepted(rpc, handler, PUSH, TokenCheck("secret"))
    assert call(refused, b"push", FakeContext()) is None
    assert reached == []
    assert value(registry, "paramserve_rpc_handled_total", method=PUSH,
                 code="UNAUTHENTICATED") == 1
    # A method the daemon does not serve, refused the same way: no label of the caller's.
    made_up = rpc.intercept_service(
        lambda d: TokenCheck("secret").intercept_service(lambda _: None, d),
        details("/made.Up/Method"))
    assert call(made_up, b"x", FakeContext()) is None
    assert value(registry, "paramserve_rpc_handled_total", method=OTHER_METHOD,
                 code="UNAUTHENTICATED") == 1
    assert value(registry, "paramserve_rpc_handled_total", method="/made.Up/Method",
                 code="UNAUTHENTICATED") == 0


def test_refused_calls_to_made_up_methods_leave_nothing_behind(rpc):
    # An unauthenticated caller names any method it likes, as long as it likes: what the
    # daemon keeps per call must not grow with them.
    def refused_made_up(i):
        method = f"/made.Up/Method{i}{'x' * 2000}"
        handler = rpc.intercept_service(
            lambda d: TokenCheck("secret").intercept_service(lambda _: None, d),
            details(method))
        assert call(handler, b"x", FakeContext()) is None

    refused_made_up(-1)  # the "other" label's metrics are made once
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(300):
            refused_made_up(i)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 100_000, f"{kept} bytes kept after 300 refused calls of 2 KB names"


def test_an_unknown_method_without_a_token_is_left_to_grpc(rpc):
    assert rpc.intercept_service(lambda d: None, details("/made.Up/Method")) is None


def streamed(chunks):
    return grpc.unary_stream_rpc_method_handler(
        lambda request, context: iter(chunks), request_deserializer=lambda raw: raw,
        response_serializer=lambda chunk: chunk)


def test_a_streamed_answer_is_timed_to_the_end_of_the_call(registry, rpc):
    handler = intercepted(rpc, streamed([b"aa", b"bbb"]), PULL)
    context = FakeContext()
    sent = [handler.response_serializer(c) for c in handler.unary_stream(b"req", context)]
    assert sent == [b"aa", b"bbb"]
    assert value(registry, "paramserve_rpc_in_flight", method=PULL) == 1  # until it ends
    context.end()
    assert value(registry, "paramserve_rpc_handled_total", method=PULL, code="OK") == 1
    assert value(registry, "paramserve_rpc_sent_bytes_total", method=PULL) == 5
    assert value(registry, "paramserve_rpc_in_flight", method=PULL) == 0


def test_a_stream_its_client_left_is_counted_cancelled(registry, rpc):
    handler = intercepted(rpc, streamed([b"aa", b"bbb"]), PULL)
    context = FakeContext()
    answers = handler.unary_stream(b"req", context)
    next(answers)
    answers.close()  # gRPC stops reading: the client is gone
    context.end()
    assert value(registry, "paramserve_rpc_handled_total", method=PULL, code="CANCELLED") == 1
    assert value(registry, "paramserve_rpc_handled_total", method=PULL, code="OK") == 0


def test_a_stream_that_fails_midway_is_counted_with_its_code(registry, rpc):
    def failing(request, context):
        yield b"aa"
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")

    handler = intercepted(rpc, grpc.unary_stream_rpc_method_handler(failing), PULL)
    context = FakeContext()
    with pytest.raises(Aborted):
        list(handler.unary_stream(b"req", context))
    context.end()
    assert value(registry, "paramserve_rpc_handled_total", method=PULL,
                 code="RESOURCE_EXHAUSTED") == 1


def test_push_socket_calls_are_counted_by_code(registry):
    socket = PushSocketMetrics(registry)

    def handle(request):
        if request == "bad":
            raise InvalidArgument("malformed")
        if request == "bug":
            raise RuntimeError("bug")
        return "reply"

    counted = socket.filter(handle)
    assert counted("ok") == "reply"
    for request, error in (("bad", InvalidArgument), ("bug", RuntimeError)):
        with pytest.raises(error):
            counted(request)
    for code in ("OK", "INVALID_ARGUMENT", "INTERNAL"):
        assert value(registry, "paramserve_push_socket_handled_total", code=code) == 1
    assert value(registry, "paramserve_push_socket_handling_seconds_count") == 3


def fake_coordinator(checkpoint=None):
    snapshot = {"state": JobState.RUNNING, "epoch": 2, "epochs": 4, "tasks_done": 3,
                "tasks_total": 12, "steps": 100, "elapsed_s": 4.0,
                "workers": [{"state": "alive"}, {"state": "alive"}, {"state": "dead"}]}
    return SimpleNamespace(
        state=SimpleNamespace(server_states=lambda: [(None, "alive", 0.1), (None, "lost", 70.0)]),
        runner=SimpleNamespace(snapshot=lambda: snapshot, waiting_leases=1),
        clients=SimpleNamespace(live_count=lambda: 2),
        checkpointer=None if checkpoint is None else SimpleNamespace(
            catalog=SimpleNamespace(current=lambda: checkpoint)))


def test_the_coordinator_collector_reads_members_progress_and_checkpoint_age(registry):
    registry.register(CoordinatorCollector(
        fake_coordinator(SimpleNamespace(created_unix_s=1000.0, step=80)), clock=lambda: 1030.0))
    assert value(registry, "paramserve_members", role="server", state="alive") == 1
    assert value(registry, "paramserve_members", role="server", state="lost") == 1
    assert value(registry, "paramserve_members", role="server", state="dead") == 0
    assert value(registry, "paramserve_members", role="worker", state="alive") == 2
    assert value(registry, "paramserve_members", role="worker", state="dead") == 1
    # The 2 PSClients that asked for an incarnation, and the 2 live workers' own.
    assert value(registry, "paramserve_members", role="client", state="alive") == 4
    assert value(registry, "paramserve_job_state", state="running") == 1
    assert value(registry, "paramserve_job_state", state="done") == 0
    assert value(registry, "paramserve_job_progress_ratio") == 0.25
    assert value(registry, "paramserve_job_tasks_done_total") == 3
    assert value(registry, "paramserve_job_steps_total") == 100
    assert value(registry, "paramserve_job_steps_per_second") == 25
    assert value(registry, "paramserve_job_waiting_leases") == 1
    assert value(registry, "paramserve_checkpoint_age_seconds") == 30
    assert value(registry, "paramserve_checkpoint_step") == 80


def test_no_checkpoint_no_checkpoint_age(registry):
    registry.register(CoordinatorCollector(fake_coordinator(None)))
    assert registry.get_sample_value("paramserve_checkpoint_age_seconds") is None
    assert value(registry, "paramserve_job_steps_total") == 100
