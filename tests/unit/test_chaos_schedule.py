"""The chaos schedule of `ps-cluster --chaos` on made-up statuses: what it kills, in which
order, when, and what counts as recovered."""

from __future__ import annotations

import pytest

from ps_worker.chaos import ChaosError, ChaosMonkey, missing_evidence, plan


def make_status(*, tasks_done: int = 0, steps: int = 0, state: str = "running",
                incarnation: int = 1, state_losses: int = 0, checkpoint_step: int | None = None,
                generation: int = 7) -> dict:
    """The parts of `ps-ctl status --json` that chaos reads: 1 worker, 1 server, 100 tasks."""
    return {
        "job": {"state": state, "tasks_done": tasks_done, "tasks_total": 100, "steps": steps,
                "failure": ""},
        "workers": [{"id": "worker-0", "incarnation": incarnation, "state": "alive",
                     "leased_tasks": []}],
        "servers": [{"id": "ps-0", "state": "alive", "state_losses": state_losses}],
        "generation": generation,
        "last_checkpoint": None if checkpoint_step is None else {"step": checkpoint_step},
    }


class FakeMember:
    def __init__(self, name: str, events: list[str]):
        self.name, self.events = name, events

    def kill(self) -> bool:
        self.events.append(f"kill {self.name}")
        return True

    def restart(self) -> None:
        self.events.append(f"restart {self.name}")


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_monkey(events: list[str], clock: FakeClock) -> ChaosMonkey:
    targets = plan(3, workers={"worker-0": "worker-0"}, servers={"server-0": "ps-0"})
    members = {n: FakeMember(n, events) for n in ("worker-0", "server-0", "coordinator")}
    return ChaosMonkey(3, targets, members, clock=clock, recovery_timeout_s=60.0)


def test_the_plan_is_a_worker_then_a_server_then_the_coordinator_chosen_by_the_seed():
    workers = {f"worker-{i}": f"worker-{i}" for i in range(4)}
    servers = {f"server-{i}": f"ps-{i}" for i in range(4)}
    plans = {seed: plan(seed, workers, servers) for seed in range(20)}
    assert plans[1] == plan(1, workers, servers)
    for targets in plans.values():
        assert [t.role for t in targets] == ["worker", "server", "coordinator"]
        assert targets[1].member_id == servers[targets[1].child]
    assert len({targets[0].child for targets in plans.values()}) > 1
    assert [t.role for t in plan(1, {}, servers)] == ["server", "coordinator"]


def test_kills_come_one_at_a_time_each_after_the_previous_recovered():
    events: list[str] = []
    clock = FakeClock()
    monkey = make_monkey(events, clock)
    monkey.observe(make_status(tasks_done=9, steps=40))
    assert events == []  # below 10% of the tasks
    monkey.observe(make_status(tasks_done=40, steps=200))
    assert events == ["kill worker-0", "restart worker-0"]
    clock.now = 1.0
    # Far enough for the server, but the worker has not registered again: nothing more.
    monkey.observe(make_status(tasks_done=41, steps=210))
    monkey.observe(None)
    assert len(events) == 2 and monkey.missing is not None
    clock.now = 2.0
    monkey.observe(make_status(tasks_done=42, steps=216, incarnation=2))
    assert monkey.kills[0].recovered_after_s == 2.0
    # No checkpoint yet: the server is spared until there is one.
    monkey.observe(make_status(tasks_done=42, steps=216, incarnation=2))
    assert len(events) == 2
    monkey.observe(make_status(tasks_done=43, steps=222, incarnation=2, checkpoint_step=200))
    assert events[2:] == ["kill server-0", "restart server-0"]
    # Back, but not yet restored (no state loss counted): not recovered.
    monkey.observe(make_status(tasks_done=44, steps=230, incarnation=2, checkpoint_step=200))
    assert monkey.kills[1].recovered_after_s is None
    monkey.observe(make_status(tasks_done=60, steps=300, incarnation=2, checkpoint_step=200,
                               state_losses=1))
    assert monkey.kills[1].recovered_after_s is not None
    monkey.observe(make_status(tasks_done=61, steps=306, incarnation=2, state_losses=1,
                               checkpoint_step=300))
    assert events[4:] == ["kill coordinator", "restart coordinator"]
    # The same generation answering is the killed coordinator, whatever the steps say.
    monkey.observe(make_status(tasks_done=62, steps=312, incarnation=2, state_losses=1))
    assert not monkey.complete
    monkey.observe(make_status(tasks_done=62, steps=312, incarnation=2, state_losses=1,
                               generation=8))
    assert monkey.complete
    report = monkey.report()
    assert [k["target"] for k in report["kills"]] == ["worker-0", "server-0", "coordinator"]
    assert [k["at_step"] for k in report["kills"]] == [200, 222, 306]
    assert report["updates_lost"] == 222 - 200  # the server's steps since its checkpoint


def test_a_recovery_that_never_comes_ends_chaos_naming_the_target_and_what_is_missing():
    events: list[str] = []
    clock = FakeClock()
    monkey = make_monkey(events, clock)
    monkey.observe(make_status(tasks_done=40, steps=200))
    clock.now = 59.0
    monkey.observe(make_status(tasks_done=40, steps=200, incarnation=2))  # no progress
    clock.now = 61.0
    with pytest.raises(ChaosError) as raised:
        monkey.observe(None)
    assert raised.value.target == "worker-0"
    assert raised.value.missing == missing_evidence(
        monkey.kills[0], make_status(tasks_done=40, steps=200, incarnation=2))


def test_a_job_that_stalls_after_a_recovery_ends_chaos():
    """A restarted member may let the job take a few steps and then hold it forever (a task
    leased to a worker that no longer has it): recovery also means progress goes on."""
    events: list[str] = []
    clock = FakeClock()
    monkey = make_monkey(events, clock)
    monkey.observe(make_status(tasks_done=40, steps=200))
    clock.now = 1.0
    monkey.observe(make_status(tasks_done=41, steps=206, incarnation=2))
    assert monkey.kills[0].recovered_after_s == 1.0
    clock.now = 60.0
    monkey.observe(make_status(tasks_done=41, steps=206, incarnation=2))  # 59 s: patience
    clock.now = 62.0
    with pytest.raises(ChaosError) as raised:
        monkey.observe(make_status(tasks_done=41, steps=206, incarnation=2))
    assert raised.value.target == "worker-0"
    assert len(events) == 2  # nothing more was killed meanwhile (no checkpoint)


def test_nothing_is_killed_once_the_job_is_over():
    events: list[str] = []
    monkey = make_monkey(events, FakeClock())
    monkey.observe(make_status(tasks_done=100, steps=480, state="done"))
    assert events == [] and not monkey.complete
