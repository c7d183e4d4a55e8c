"""A task the coordinator acknowledges as done is on disk first, for a repeated report too.

A repeat arrives while the first report's save is still being written when the worker's
first attempt failed UNAVAILABLE (a connection reset mid-call; CoordinatorClient retries
it) or when another worker reports the same task (a resumed one). Answering it at once
would tell its caller the task is done while the state file does not hold it: a
coordinator that died then would resume with the task not done.

Deterministic: the first report's state save is held (bounded) until the repeat has been
answered, or, where the repeat waits for the save, until the repeat's handler asks for the
save lock. Real gRPC on 127.0.0.1, an in-process Coordinator."""

from __future__ import annotations

import threading

import ps_server.coordinator.app as coordinator_app
from ps_common.job import JobSpec
from ps_server.coordinator.app import Coordinator, CoordinatorConfig
from ps_server.coordinator.persistence import StateFile
from ps_worker.coordinator_client import CoordinatorClient

WAIT_S = 10.0
JOB = JobSpec(epochs=2, tasks_per_epoch=2)


class _SignallingLock:
    """The coordinator's save lock; says when a marked thread asks for it."""

    def __init__(self, lock, marked: set[int], asked: threading.Event):
        self._lock, self._marked, self._asked = lock, marked, asked

    def __enter__(self):
        if threading.get_ident() in self._marked:
            self._asked.set()
        return self._lock.__enter__()

    def __exit__(self, *exc):
        return self._lock.__exit__(*exc)


def test_a_repeated_completion_is_not_answered_before_the_first_one_is_saved(
        tmp_path, monkeypatch):
    monkeypatch.setattr(coordinator_app, "STATE_SAVE_INTERVAL_S", 3600.0)  # no periodic save
    coordinator = Coordinator(CoordinatorConfig(job=JOB, state_dir=tmp_path,
                                                checkpoint_every=None)).start()
    release = threading.Event()
    first_save_held = threading.Event()
    repeat_handlers: set[int] = set()
    calls = []
    first_thread = None
    clients = []
    try:
        runner = coordinator.runner
        original_complete = runner.complete

        def complete(*args, **kwargs):
            duplicate = original_complete(*args, **kwargs)
            calls.append(duplicate)
            if len(calls) >= 2:
                repeat_handlers.add(threading.get_ident())
            return duplicate

        runner.complete = complete
        coordinator._saving = _SignallingLock(coordinator._saving, repeat_handlers, release)
        state_file = coordinator._state_file
        original_save = state_file.save

        def save(state):
            if state["job"]["tasks_done"] >= 1 and not first_save_held.is_set():
                first_save_held.set()
                release.wait(WAIT_S)  # the first report's save is slow (fsync on NFS, say)
            original_save(state)

        state_file.save = save

        first = CoordinatorClient(coordinator.address, rpc_timeout_s=3 * WAIT_S)
        retry = CoordinatorClient(coordinator.address, rpc_timeout_s=3 * WAIT_S)
        clients += [first, retry]
        incarnation = first.register_worker("w0").incarnation
        outcome, task = first.lease("w0", incarnation)
        assert outcome == "task"
        report = dict(loss_sum=1.0, examples=4, correct=3, steps=2, seconds=0.1)

        answers = {}
        first_thread = threading.Thread(
            target=lambda: answers.setdefault("first", first.complete(
                "w0", incarnation, task.task_id, **report)),
            name="first-report", daemon=True)
        first_thread.start()
        assert first_save_held.wait(WAIT_S)

        # The same report again (the retry of an attempt that failed UNAVAILABLE).
        answers["repeat"] = retry.complete("w0", incarnation, task.task_id, **report)
        on_disk = StateFile(coordinator.config.state_path).load()
        release.set()
        first_thread.join(WAIT_S)
        assert not first_thread.is_alive()

        assert answers == {"first": False, "repeat": True}
        # Told "done" (a duplicate of a done task): the state a restart resumes from says so.
        assert on_disk is not None
        assert on_disk["job"]["tasks_done"] == 1, (
            "the repeat was answered 'already done' while the state file still had the task "
            f"not done (tasks_done {on_disk['job']['tasks_done']})")
    finally:
        release.set()
        if first_thread is not None:
            first_thread.join(WAIT_S)
        for client in clients:
            client.close()
        coordinator.stop(grace_s=0)
