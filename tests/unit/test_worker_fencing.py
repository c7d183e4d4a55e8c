"""A worker's heartbeat answered about an incarnation the worker has replaced meanwhile does
not fence the live one. Worker.run is driven with a fake coordinator and a fake PSClient (no
sockets); every wait is a bounded wait for an event."""

from __future__ import annotations

import threading

import ps_worker.runtime as runtime
from ps_common.job import JobSpec
from ps_worker.client import StepStats
from ps_worker.coordinator_client import Registration
from ps_worker.runtime import Worker, WorkerConfig

JOB = JobSpec(model="logreg", data="synthetic:40", epochs=1, tasks_per_epoch=1)
WAIT_S = 10.0  # a bound a sound build never reaches
FIRST = 100


class FakePSClient:
    def __init__(self, *args, **kwargs):
        self.data_paths, self.mode, self.step_stats = {}, "async", StepStats()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def declare_many(self, specs):
        pass

    def interrupt(self):
        pass


class FakeCoordinator:
    """Incarnation 100's heartbeat is in flight while the worker learns from a lease that
    100 is gone and registers as 101; only then is that heartbeat answered (`reregister`,
    true of 100). The worker then finds the job done."""

    def __init__(self):
        self.registrations: list[int] = []
        self.stale_in_flight = threading.Event()
        self.answer_stale = threading.Event()
        self.stale_answered = threading.Event()
        self.heartbeat_after_stale = threading.Event()

    def register_worker(self, worker_id):
        self.registrations.append(FIRST + len(self.registrations))
        return Registration(self.registrations[-1], JOB, 0.01)

    def heartbeat(self, worker_id, incarnation, data_path="", step_stats=None):
        if incarnation == FIRST and not self.stale_in_flight.is_set():
            self.stale_in_flight.set()
            self.answer_stale.wait(WAIT_S)
            self.stale_answered.set()
            return "reregister"
        if self.stale_answered.is_set():
            self.heartbeat_after_stale.set()  # the stale answer has been acted on
        return "continue" if incarnation == self.registrations[-1] else "reregister"

    def lease(self, worker_id, incarnation, *, wait_s=0.0):
        if incarnation == FIRST:
            self.stale_in_flight.wait(WAIT_S)
            return "reregister", None
        if not self.answer_stale.is_set():
            self.answer_stale.set()
            self.heartbeat_after_stale.wait(WAIT_S)
            return "wait", 0.0
        return "done", None

    def report_job_error(self, *args, **kwargs):
        raise AssertionError("no job error is expected")

    def interrupt_waits(self):
        pass

    def close(self):
        pass


def test_a_stale_heartbeat_answer_does_not_fence_the_new_incarnation(monkeypatch):
    monkeypatch.setattr(runtime, "PSClient", FakePSClient)
    worker = Worker(WorkerConfig(coordinator="127.0.0.1:9", device="cpu", worker_id="w0",
                                 shared_memory=False))
    worker._coordinator.close()
    worker._coordinator = fake = FakeCoordinator()
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", worker.run()),
                              name="worker-run", daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        worker.request_stop()
        thread.join(WAIT_S)
    assert result.get("rc") == 0
    assert fake.heartbeat_after_stale.is_set()
    assert fake.registrations == [FIRST, FIRST + 1]  # 101 was never fenced
