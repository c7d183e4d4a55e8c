"""A heartbeat's `reregister`, true of the incarnation the worker ran when the heartbeat
thread checked it, must not interrupt the PSClient of the incarnation that replaced it: the
heartbeat thread picks the client to interrupt with its check, under `_incarnation_lock`.
Interrupting the new, live client instead would be for good (its next call raises
CANCELLED, and ps-worker exits 1).

The interleaving is forced: the heartbeat thread, once it releases `_incarnation_lock` after
the fence, waits (bounded) until the main thread has re-registered and watched its second
client; the main thread then waits until the heartbeat thread comes back for its next beat.
Worker.run is driven with a fake coordinator and fake PSClients (no sockets)."""

from __future__ import annotations

import threading

import grpc

import ps_worker.runtime as runtime
from ps_common.job import JobSpec
from ps_common.status import RemoteError
from ps_worker.client import StepStats
from ps_worker.coordinator_client import Registration
from ps_worker.runtime import Worker, WorkerConfig

JOB = JobSpec(model="logreg", data="synthetic:40", epochs=1, tasks_per_epoch=1)
WAIT_S = 10.0  # a bound a sound build never reaches
FIRST = 100

CLIENTS: list["FakePSClient"] = []


class FakePSClient:
    def __init__(self, *args, **kwargs):
        self.incarnation = kwargs.get("incarnation")
        self.data_paths, self.mode, self.step_stats = {}, "async", StepStats()
        self.interrupted = threading.Event()
        CLIENTS.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def declare_many(self, specs):
        if self.interrupted.is_set():  # what PSClient does once interrupted: for good
            raise RemoteError(grpc.StatusCode.CANCELLED, "the caller stopped waiting")

    def interrupt(self):
        self.interrupted.set()


class FakeCoordinator:
    """Incarnation 100 is declared dead: its heartbeat answers `reregister`, and so does its
    lease, once the heartbeat thread has acted on the first. 101 finds the job done."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self.registrations: list[int] = []
        self.beats = 0
        self.next_beat = threading.Event()  # the heartbeat thread acted on its first answer

    def register_worker(self, worker_id):
        self.registrations.append(FIRST + len(self.registrations))
        return Registration(self.registrations[-1], JOB, 0.01)

    def heartbeat(self, worker_id, incarnation, data_path="", step_stats=None):
        self.beats += 1
        if self.beats > 1:
            self.next_beat.set()
        return "reregister" if incarnation == FIRST else "continue"

    def lease(self, worker_id, incarnation, *, wait_s=0.0):
        if incarnation == FIRST:
            # The heartbeat thread has seen 100 fenced (it set _fenced under the lock).
            self.worker._fenced.wait(WAIT_S)
            return "reregister", None
        return "done", None

    def report_job_error(self, *args, **kwargs):
        raise AssertionError("no job error is expected")

    def interrupt_waits(self):
        pass

    def close(self):
        pass


def test_a_fence_of_the_old_incarnation_does_not_interrupt_the_new_incarnations_client(
        monkeypatch):
    CLIENTS.clear()
    monkeypatch.setattr(runtime, "PSClient", FakePSClient)
    worker = Worker(WorkerConfig(coordinator="127.0.0.1:9", device="cpu", worker_id="w0",
                                 shared_memory=False))
    worker._coordinator.close()
    worker._coordinator = fake = FakeCoordinator(worker)

    second_watched = threading.Event()
    original_watch = worker._watch_client

    def watch_client(ps):
        original_watch(ps)
        if ps.incarnation == FIRST + 1:
            second_watched.set()
            fake.next_beat.wait(WAIT_S)  # whatever the fence's thread does, it has done

    class PausingLock:
        """The incarnation lock; the heartbeat thread, once it releases it after setting
        the fence, loses the CPU until the main thread has watched its next client."""

        def __init__(self, lock):
            self._lock = lock

        def __enter__(self):
            return self._lock.__enter__()

        def __exit__(self, *exc):
            self._lock.__exit__(*exc)
            if threading.current_thread().name.endswith("-heartbeat") and \
                    worker._fenced.is_set():
                second_watched.wait(WAIT_S)

    worker._watch_client = watch_client
    worker._incarnation_lock = PausingLock(worker._incarnation_lock)

    result = {}

    def run():
        try:
            result["rc"] = worker.run()
        except BaseException as error:  # noqa: BLE001 - asserted below
            result["error"] = error

    thread = threading.Thread(target=run, name="worker-run", daemon=True)
    thread.start()
    thread.join(3 * WAIT_S)
    if thread.is_alive():
        worker.request_stop()
        thread.join(WAIT_S)
    assert not thread.is_alive()

    assert fake.registrations == [FIRST, FIRST + 1]
    # The worker runs on to the end of the job instead of dying with CANCELLED...
    assert result == {"rc": 0}, result
    # ...because the fence was about incarnation 100: the live incarnation's client is not
    # touched.
    new_client = next(c for c in CLIENTS if c.incarnation == FIRST + 1)
    assert not new_client.interrupted.is_set(), (
        "the heartbeat thread's reregister for incarnation 100 interrupted the PSClient of "
        "incarnation 101")
