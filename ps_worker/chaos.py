"""`ps-cluster --chaos`: SIGKILL a worker, then a server, then the coordinator, one at a time,
each restarted as a supervisor would restart it (docker compose's `restart: on-failure`, a
Kubernetes StatefulSet: the same command, the same id, the same address), and wait for
evidence that the cluster recovered before the next kill.

The decisions are pure functions of one coordinator status (`ready_to_kill`,
`missing_evidence`);
`ChaosMonkey` performs them on ps-cluster's children. Like ps-cluster, it reads the
coordinator's status and imports none of the daemons' internals.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

# When each kill may come, as the fraction of the job's tasks done: early, because the
# default job lasts a few seconds and each kill waits for a process to start again.
KILL_AT_PROGRESS = {"worker": 0.10, "server": 0.35, "coordinator": 0.60}
# How long the cluster may take to show it recovered from one kill: a restarted process
# must start (seconds), register and, for a server, restore its shards from a checkpoint.
RECOVERY_TIMEOUT_S = 60.0
NO_ANSWER_YET = "the coordinator has not answered"


class ChaosError(RuntimeError):
    """The cluster did not recover from a kill in time: `target` (a child's name) and
    `missing`, the evidence of recovery that never came."""

    def __init__(self, target: str, missing: str, since_kill_s: float):
        super().__init__(f"chaos: the cluster did not recover from the kill of {target} "
                         f"({since_kill_s:.0f} s ago): {missing}")
        self.target, self.missing = target, missing


class Restartable(Protocol):
    """A child process that a supervisor restarts: `kill()` SIGKILLs and reaps it (bounded),
    and says whether the SIGKILL ended it (False: it had exited by itself, its own exit
    status kept); `restart()` starts it again with the same command line, on the same
    address."""

    name: str

    def kill(self) -> bool: ...

    def restart(self) -> None: ...


@dataclass(frozen=True)
class Target:
    child: str  # ps-cluster's name for the process: worker-1, server-0, coordinator
    member_id: str  # its id in the coordinator's status: worker-1, ps-0; "" for the coordinator
    role: str  # worker | server | coordinator

    @property
    def at_progress(self) -> float:
        return KILL_AT_PROGRESS[self.role]


def plan(seed: int, workers: Mapping[str, str], servers: Mapping[str, str]) -> list[Target]:
    """A random worker, then a random server, then the coordinator. `workers` and `servers`
    map child names to member ids; a role with no member is left out."""
    rng = random.Random(seed)
    targets = []
    for role, members in (("worker", workers), ("server", servers)):
        if members:
            child = rng.choice(sorted(members))
            targets.append(Target(child, members[child], role))
    targets.append(Target("coordinator", "", "coordinator"))
    return targets


def progress(status: dict) -> float:
    job = status["job"]
    return job["tasks_done"] / max(1, job["tasks_total"])


def member_row(status: dict, target: Target) -> dict | None:
    rows = status["workers"] if target.role == "worker" else status["servers"]
    return next((row for row in rows if row["id"] == target.member_id), None)


def ready_to_kill(target: Target, status: dict) -> bool:
    """Whether `target` may be killed now: the job is running and far enough along, the
    target is a live member (a kill before it registered would test nothing), and for a
    server, a checkpoint exists to restore it from."""
    if status["job"]["state"] != "running" or progress(status) < target.at_progress:
        return False
    if target.role == "coordinator":
        return True
    row = member_row(status, target)
    if row is None or row["state"] != "alive":
        return False
    return target.role != "server" or status["last_checkpoint"] is not None


@dataclass
class Kill:
    """One kill: what the status said just before it, and what came of it."""

    target: Target
    at_step: int
    killed_at: float  # monotonic seconds
    before: dict  # the status read just before the kill
    restarted: bool = False
    recovered_after_s: float | None = None

    @property
    def updates_lost(self) -> int:
        """What the checkpoint bound says this kill may have lost: the steps trained since the
        last checkpoint, for a server (its memory is gone); nothing for a worker (its task
        runs again) or the coordinator (it resumes from its state file)."""
        if self.target.role != "server":
            return 0
        checkpoint = self.before["last_checkpoint"]
        return max(0, self.at_step - (checkpoint["step"] if checkpoint else 0))

    def record(self) -> dict:
        return {"target": self.target.child, "at_step": self.at_step, "signal": "SIGKILL",
                "restarted": self.restarted,
                "recovered_after_s": (None if self.recovered_after_s is None
                                      else round(self.recovered_after_s, 3))}


def missing_evidence(kill: Kill, status: dict) -> str | None:
    """What is still missing before the cluster counts as whole again after `kill` (None:
    nothing). The evidence: training went on past the step of the kill (or the job is done),
    and the killed member is back as a new process: a worker under a new incarnation, a
    server re-registered after the coordinator saw it come back empty (one more state loss:
    it was restored), a coordinator of a new generation with every server registered again."""
    job = status["job"]
    if job["state"] == "failed":
        return f"the job failed: {job['failure']}"
    if not (job["steps"] > kill.at_step or job["state"] == "done"):
        held = {w["id"]: w["leased_tasks"] for w in status["workers"] if w["leased_tasks"]}
        return (f"the job's steps are still {job['steps']} (killed at {kill.at_step}); "
                f"{job['tasks_done']} of {job['tasks_total']} task(s) done; leased: {held}")
    target = kill.target
    if target.role == "coordinator":
        if status["generation"] == kill.before["generation"]:
            return "the coordinator answering is the one that was killed"
        if job["state"] == "done":
            # The restarted coordinator took the job to its end: workers train on while it
            # is down and report their tasks to it at once, so a job near its end may be
            # done before any server has heartbeated to it, which is no missing evidence.
            return None
        # A restarted coordinator lists in `servers` only those that registered with it; the
        # rest of the shard map it recovered are in `awaiting_servers` until they do. One
        # told the job is over ("done") registered with it too: a job that ends soon after
        # the restart may end before a status shows it alive.
        back = {s["id"] for s in status["servers"] if s["state"] in ("alive", "done")}
        away = sorted(set(status.get("awaiting_servers", []))
                      | ({s["id"] for s in kill.before["servers"]} - back)
                      | {s["id"] for s in status["servers"] if s["id"] not in back})
        return f"server(s) {away} not registered again" if away else None
    row, earlier = member_row(status, target), member_row(kill.before, target)
    if row is None or earlier is None:
        return f"{target.member_id} is not in the status"
    if target.role == "worker":
        if row["incarnation"] > earlier["incarnation"] and row["state"] in ("alive", "done"):
            return None
        return f"{target.member_id} has not registered again (state {row['state']})"
    if row["state"] == "alive" and row["state_losses"] > earlier["state_losses"]:
        return None
    return (f"{target.member_id} is {row['state']}, {row['state_losses']} state loss(es) "
            "counted: not yet back and restored")


@dataclass
class ChaosMonkey:
    """Kills `targets` in order, one at a time, each once the previous one has recovered.

    Not thread-safe: `observe` is called from ps-cluster's monitor loop, on the main thread
    (children must be started from it: see cluster.Child). Kill and restart
    happen within one `observe` call, so the monitor never sees a killed child as exited.
    `observe` raises ChaosError when a recovery takes longer than `recovery_timeout_s`, and
    when, after the first kill, the job goes that long without completing a task: a cluster
    that took a few steps after a restart and then stalled did not recover either.
    """

    seed: int
    targets: list[Target]
    members: Mapping[str, Restartable]
    clock: Callable[[], float]
    note: Callable[[str], None] = lambda text: None
    recovery_timeout_s: float = RECOVERY_TIMEOUT_S
    kills: list[Kill] = field(default_factory=list)
    # Why the latest status was not yet evidence of recovery (for the timeout's message).
    missing: str | None = field(default=None, init=False)
    # The job's (tasks done, steps) when last seen to change, and when that was.
    _progress: tuple[int, int] | None = field(default=None, init=False)
    _progress_at: float = field(default=0.0, init=False)
    _exited: set[str] = field(default_factory=set, init=False)  # found exited, not killed

    @property
    def _recovering(self) -> Kill | None:
        last = self.kills[-1] if self.kills else None
        return last if last is not None and last.recovered_after_s is None else None

    def observe(self, status: dict | None) -> None:
        """Act on the latest status (None: the coordinator did not answer)."""
        now = self.clock()
        self._note_progress(status, now)
        pending = self._recovering
        if pending is not None:
            if status is not None:
                self.missing = missing_evidence(pending, status)
                if self.missing is None:
                    pending.recovered_after_s = now - pending.killed_at
                    self.note(f"chaos: recovered from the kill of {pending.target.child} in "
                              f"{pending.recovered_after_s:.1f} s (step "
                              f"{status['job']['steps']})")
                    return
            if now - pending.killed_at > self.recovery_timeout_s:
                raise ChaosError(pending.target.child, self.missing or NO_ANSWER_YET,
                                 now - pending.killed_at)
            return
        self._check_not_stalled(now)
        if status is None or len(self.kills) == len(self.targets):
            return
        target = self.targets[len(self.kills)]
        if ready_to_kill(target, status):
            self._kill(target, status)

    def _note_progress(self, status: dict | None, now: float) -> None:
        if status is not None:
            job = status["job"]
            mark = (job["tasks_done"], job["steps"])
            if mark != self._progress or job["state"] != "running":
                self._progress, self._progress_at = mark, now

    def _check_not_stalled(self, now: float) -> None:
        if self.kills and now - self._progress_at > self.recovery_timeout_s:
            tasks, steps = self._progress or (0, 0)
            last = self.kills[-1]
            raise ChaosError(last.target.child,
                             f"the job made no progress for {now - self._progress_at:.0f} s "
                             f"({tasks} task(s) done, {steps} step(s))", now - last.killed_at)

    def _kill(self, target: Target, status: dict) -> None:
        if target.child in self._exited:
            return
        member = self.members[target.child]
        at_step = status["job"]["steps"]
        if not member.kill():
            # It exited after the status that showed it alive was read (told the job is
            # over, or it failed): nothing was killed, and its own exit status stands.
            self._exited.add(target.child)
            self.note(f"chaos: {target.child} exited by itself before its kill at step "
                      f"{at_step}; not killed")
            return
        kill = Kill(target, at_step=at_step, killed_at=self.clock(), before=status)
        self.kills.append(kill)
        self.missing = NO_ANSWER_YET
        self.note(f"chaos: {signal.Signals.SIGKILL.name} {target.child} at step {kill.at_step}")
        member.restart()
        kill.restarted = True

    @property
    def recoveries(self) -> int:
        return sum(k.recovered_after_s is not None for k in self.kills)

    @property
    def complete(self) -> bool:
        """Every target was killed and the cluster recovered from each."""
        return self.recoveries == len(self.targets)

    def report(self) -> dict:
        return {"seed": self.seed, "kills": [k.record() for k in self.kills],
                "updates_lost": sum(k.updates_lost for k in self.kills)}
