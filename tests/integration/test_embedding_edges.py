"""Embedding tables at their edges, each with the exact values or outcome the README
promises: push_pull_rows at the largest chunk size, float16 gradients of a repeated id, and
a user's model with tables in the sync mode."""

from __future__ import annotations

import threading

import numpy as np

from ps_common.job import JobSpec
from ps_common.rpc import MAX_CHUNK_BYTES
from ps_worker import PSClient
from ps_worker.client import MAX_ROW_IDS_PER_CALL
from ps_worker.coordinator_client import LeasedTask, Registration
from ps_worker.runtime import JobCannotRun, Worker, WorkerConfig

SHARED_MEMORY = False  # what travels on the wire is what these tests are about
SGD1 = {"name": "sgd", "lr": 1.0}
WAIT_S = 60.0  # a bound a sound build never reaches


# ---- push_pull_rows at the largest chunk size ----------------------------------------------

def test_push_pull_rows_of_a_full_batch_at_the_largest_chunk_size_is_applied_and_pulled(
        make_cluster):
    """README: push_pull_rows "is push_rows(...) followed by pull_rows(...), with the same
    values and errors" and PSClient takes chunk_bytes up to 3 MiB "so no peer needs its
    limits raised". The two calls in turn succeed; the one call must too."""
    cluster = make_cluster(servers=1)
    dim = MAX_CHUNK_BYTES // (MAX_ROW_IDS_PER_CALL * 4)  # 12: one batch is one full chunk
    ids = np.arange(MAX_ROW_IDS_PER_CALL, dtype=np.int64)
    grads = np.ones((len(ids), dim), np.float32)
    with PSClient(cluster.coordinator_address, chunk_bytes=MAX_CHUNK_BYTES) as ps:
        ps.declare_embedding("emb", dim=dim, num_rows=len(ids), init="zeros", optimizer=SGD1)
        # The same two parts in turn: fine.
        ps.push_rows("emb", ids, grads)
        np.testing.assert_array_equal(ps.pull_rows("emb", ids),
                                      np.full((len(ids), dim), -1.0, np.float32))
        # In one call: the push, its 512 KiB of ids and the pull's 512 KiB of ids would make
        # one message past gRPC's 4 MiB limit: they go as two.
        rows = ps.push_pull_rows("emb", ids, grads, ids)
        np.testing.assert_array_equal(rows, np.full((len(ids), dim), -2.0, np.float32))


# ---- float16 gradients of a repeated id --------------------------------------------------

def test_float16_gradients_of_a_repeated_id_whose_sum_passes_float16_reach_a_float32_table(
        cluster):
    """README: push_rows sums the gradients of repeated ids (w[id] -= lr * sum). 60000 +
    60000 is finite in the float32 table (the server sums a row push's repeated ids in
    float32, and so does the client), so the push is applied."""
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=2, num_rows=4, init="zeros", optimizer=SGD1)
        grads = np.full((2, 2), 60000, np.float16)  # finite, as the caller sees them
        ps.push_rows("emb", np.array([1, 1], np.int64), grads)
        np.testing.assert_array_equal(ps.pull_rows("emb", np.array([1], np.int64)),
                                      np.full((1, 2), -120000.0, np.float32))


def test_float16_gradients_of_a_repeated_id_are_summed_without_rounding_to_float16(cluster):
    """The same sum, exact in float32: 2048 + 1 = 2049, as when pushed as two calls (float16
    would round it to 2048)."""
    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=1, num_rows=4, init="zeros", optimizer=SGD1)
        ps.push_rows("emb", np.array([2], np.int64), np.array([[2048]], np.float16))
        ps.push_rows("emb", np.array([2], np.int64), np.array([[1]], np.float16))
        ps.push_rows("emb", np.array([1, 1], np.int64), np.array([[2048], [1]], np.float16))
        np.testing.assert_array_equal(ps.pull_rows("emb", np.array([1, 2], np.int64)),
                                      np.array([[-2049.0], [-2049.0]], np.float32))


# ---- a model with tables in the sync mode ------------------------------------------------

FIRST = 100
# A user model with a table (EmbeddingMLP named as a module reference: JobSpec refuses sync
# only for the built-in name "embedding_mlp").
SYNC_TABLE_JOB = JobSpec(model="ps_worker.models.embedding:EmbeddingMLP",
                         data="synthetic_ctr:400", hidden=(4,), mode="sync", epochs=1,
                         tasks_per_epoch=1, batch_size=32)


class OneTaskCoordinator:
    """Hands out one training task of SYNC_TABLE_JOB, then says the job is done; records
    registrations and job errors."""

    def __init__(self):
        self.registrations: list[int] = []
        self.job_errors: list[str] = []
        self.leased = False
        self.lock = threading.Lock()

    def register_worker(self, worker_id):
        with self.lock:
            self.registrations.append(FIRST + len(self.registrations))
            return Registration(self.registrations[-1], SYNC_TABLE_JOB, 0.05)

    def heartbeat(self, worker_id, incarnation, data_path="", step_stats=None):
        return "continue"

    def lease(self, worker_id, incarnation, *, wait_s=0.0):
        with self.lock:
            if self.leased:
                return "done", None
            self.leased = True
        return "task", LeasedTask(task_id=1, kind="train", epoch=0, index=0, tasks_per_epoch=1)

    def report_job_error(self, worker_id, incarnation, message, diverged=False):
        self.job_errors.append(message)
        return True

    def complete(self, *args, **kwargs):
        return False

    def interrupt_waits(self):
        pass

    def close(self):
        pass


def test_a_user_model_with_tables_in_sync_fails_the_job_instead_of_re_registering(cluster):
    """README: "a model with embedding tables trains in async or ssp:K"; a model that cannot
    run the job is reported to the coordinator (ReportJobError), which fails it; the worker
    does not take the client's own refusal of push_rows in sync (FAILED_PRECONDITION) for a
    server's fence, re-registering and running the task again for good (here the fake
    coordinator would end the job at the second lease)."""
    worker = Worker(WorkerConfig(coordinator=cluster.coordinator_address, device="cpu",
                                 worker_id="w0", shared_memory=False))
    worker._coordinator.close()
    worker._coordinator = fake = OneTaskCoordinator()
    outcome = {}

    def run():
        try:
            outcome["rc"] = worker.run()
        except BaseException as error:  # noqa: BLE001 - inspected below
            outcome["error"] = error

    thread = threading.Thread(target=run, name="worker-run")
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        worker.request_stop()
        thread.join(WAIT_S)
    assert not thread.is_alive()
    assert fake.registrations == [FIRST], (
        f"the worker re-registered {len(fake.registrations) - 1} time(s) instead of "
        f"reporting the job error; outcome {outcome}")
    assert len(fake.job_errors) == 1 and "sync" in fake.job_errors[0], fake.job_errors
    assert isinstance(outcome.get("error"), JobCannotRun), outcome


def test_pull_rows_async_reads_the_ids_as_they_were_at_the_call(cluster, monkeypatch):
    """A trainer that refills one ids buffer for the next batch right after pull_rows_async
    gets the rows of the ids it asked for, whenever the background pull starts."""
    from concurrent.futures import Future

    with PSClient(cluster.coordinator_address) as ps:
        ps.declare_embedding("emb", dim=1, num_rows=8, init="zeros", optimizer=SGD1)
        ps.push_rows("emb", np.arange(8, dtype=np.int64),
                     -np.arange(8, dtype=np.float32).reshape(8, 1))  # row i holds i
        deferred = []

        real_submit = ps._submit

        def submit_later(pool, fn, *args, **kwargs):
            if pool is not ps._prefetch_pool:  # the pull's own calls to each server
                return real_submit(pool, fn, *args, **kwargs)
            future = Future()
            deferred.append((future, fn, args, kwargs))
            return future

        monkeypatch.setattr(ps, "_submit", submit_later)
        ids = np.array([1, 2], np.int64)
        pulled = ps.pull_rows_async("emb", ids)
        ids[:] = [5, 6]  # the next batch's ids, before the pull has started
        future, fn, args, kwargs = deferred[0]
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # the client waits for its futures when it closes
            future.set_exception(error)
        np.testing.assert_array_equal(pulled.result(), [[1.0], [2.0]])
