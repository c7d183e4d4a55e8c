"""What a ps-worker tells Prometheus (`ps-worker --metrics-port`): its steps and steps/s,
how long each step waited for its pulled values and for its pushes, the tasks it completed,
and how its tensors travel. The endpoint itself is ps_common.telemetry's.

The waits are what the training loop sees, whichever path a pull or push takes (shared
memory makes no call, so no call could be timed there): a pull prefetched a step ahead
waits nothing when the servers keep up.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

from ps_common.telemetry import LATENCY_BUCKETS, NAMESPACE


class WorkerMetrics:
    """The Trainer's and the Worker's observer (ps_worker.runtime), and a collector of the
    rest. Thread-safe. `watch(worker)` names the worker whose id and data path to show."""

    def __init__(self, registry: CollectorRegistry):
        self._steps = Counter("worker_steps", "Training steps this worker finished",
                              namespace=NAMESPACE, registry=registry)
        self._tasks = Counter("worker_tasks", "Tasks this worker completed and the "
                              "coordinator accepted, by kind (train, evaluate)", ["kind"],
                              namespace=NAMESPACE, registry=registry)
        self._pull_wait = Histogram(
            "worker_pull_wait_seconds", "Time a training step waited for its pulled values "
            "(pulls are prefetched one step ahead in async)", namespace=NAMESPACE,
            registry=registry, buckets=LATENCY_BUCKETS)
        self._push_wait = Histogram(
            "worker_push_wait_seconds", "Time a training step spent handing its gradients "
            "over: waiting for room in the window of pushes in flight, and in ssp:K and sync "
            "until its pushes were answered", namespace=NAMESPACE, registry=registry,
            buckets=LATENCY_BUCKETS)
        self._lock = threading.Lock()
        self._rate = 0.0  # steps/s of the last training task
        self._worker = None
        registry.register(self)

    def watch(self, worker) -> None:
        self._worker = worker

    # ---- observer (ps_worker.runtime) ---------------------------------------------------

    def step(self, pull_wait_s: float, push_wait_s: float) -> None:
        self._steps.inc()
        self._pull_wait.observe(pull_wait_s)
        self._push_wait.observe(push_wait_s)

    def task_done(self, kind: str, steps: int, seconds: float) -> None:
        self._tasks.labels(kind).inc()
        if kind == "train" and steps and seconds > 0:
            with self._lock:
                self._rate = steps / seconds

    # ---- collector ----------------------------------------------------------------------

    def collect(self):
        with self._lock:
            rate = self._rate
        yield GaugeMetricFamily(
            f"{NAMESPACE}_worker_steps_per_second", "Steps per second of this worker's last "
            "training task (rate(paramserve_worker_steps_total[1m]) counts the time between "
            "tasks too)", value=rate)
        worker = self._worker
        if worker is not None:
            yield InfoMetricFamily(
                f"{NAMESPACE}_worker", "This worker and how its pulls and pushes travel "
                "(shm, grpc, shm+grpc; empty before its first)",
                value={"worker_id": worker.worker_id, "data_path": worker.data_path})
