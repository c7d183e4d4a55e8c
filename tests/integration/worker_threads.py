"""In-process daemons and workers for the tests of ps-worker under failures: a coordinator
with a job and one server, and Worker.run() on a thread. Every wait is bounded."""

from __future__ import annotations

import threading

from ps_common.job import JobSpec
from ps_server.app import ParameterServer, ServerConfig
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.testing import FaultInjector
from ps_worker.runtime import Worker, WorkerConfig

WAIT_S = 60.0  # a bound a sound build never reaches


class Cluster:
    """A coordinator with `job` and one server (gRPC only), stopped by `stop()`."""

    def __init__(self, job: JobSpec, *, max_streams: int = 128, **coordinator):
        settings = dict(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0, grace_s=0.5,
                        recovery_grace_s=0.0, keep_serving=True)
        settings.update(coordinator)
        self.faults = FaultInjector()  # the coordinator's calls
        self.server_faults = FaultInjector()  # the server's calls
        self.coordinator = Coordinator(CoordinatorConfig(job=job, **settings),
                                       interceptors=[self.faults]).start()
        self.server = None
        try:
            self.server = ParameterServer(ServerConfig(
                server_id="ps-0", coordinator=self.coordinator.address,
                heartbeat_interval_s=0.2, shared_memory=False, grace_s=0.5,
                max_streams=max_streams), interceptors=[self.server_faults]).start()
            assert self.server.registered.wait(WAIT_S)
        except BaseException:
            self.stop()
            raise

    def stop(self):
        if self.server is not None:
            self.server.stop(grace_s=0.5)
        self.coordinator.stop(grace_s=0.5)


class RunningWorker:
    """Worker.run() on a thread of the given name; `outcome` gets "rc" or "error"."""

    def __init__(self, address: str, worker_id: str, thread_name: str | None = None):
        self.worker = Worker(WorkerConfig(coordinator=address, device="cpu",
                                          worker_id=worker_id, shared_memory=False))
        self.outcome: dict = {}
        self.thread = threading.Thread(target=self._run, name=thread_name or f"worker-{worker_id}",
                                       daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.outcome["rc"] = self.worker.run()
        except BaseException as error:  # noqa: BLE001 - inspected by the test
            self.outcome["error"] = error

    def join(self, timeout: float = WAIT_S) -> dict:
        self.thread.join(timeout)
        return self.outcome

    def end(self):
        self.worker.request_stop()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the worker did not stop"
