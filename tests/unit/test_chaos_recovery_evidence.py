"""What `ps-cluster --chaos` counts as recovery from the coordinator's kill: a coordinator of
a new generation with every server of the status before the kill registered with it again
and alive (README, Chaos run). A restarted coordinator lists in `servers` only the servers
that have registered with it; one of the recovered shard map that has not yet is in
`awaiting_servers` (ps-ctl status: "awaiting ... (held shards before the coordinator
restarted)"), not in `servers`."""

from __future__ import annotations

from ps_worker.chaos import Kill, Target, missing_evidence


def _status(*, generation: int, steps: int, servers: list[dict],
            awaiting: list[str]) -> dict:
    return {
        "job": {"state": "running", "tasks_done": 70, "tasks_total": 100, "steps": steps,
                "failure": ""},
        "workers": [{"id": "worker-0", "incarnation": 1, "state": "alive",
                     "leased_tasks": []}],
        "servers": servers,
        "awaiting_servers": awaiting,
        "generation": generation,
        "last_checkpoint": {"step": 300},
    }


def _server(server_id: str) -> dict:
    return {"id": server_id, "state": "alive", "state_losses": 0}


def test_a_new_coordinator_still_awaiting_a_server_is_not_recovered():
    before = _status(generation=7, steps=306, servers=[_server("ps-0"), _server("ps-1")],
                     awaiting=[])
    kill = Kill(Target("coordinator", "", "coordinator"), at_step=306, killed_at=0.0,
                before=before)
    # The new coordinator (generation 8): ps-0 registered again, ps-1 not yet; a worker's
    # task finished meanwhile (the data path never passes through the coordinator).
    after = _status(generation=8, steps=312, servers=[_server("ps-0")], awaiting=["ps-1"])
    assert missing_evidence(kill, after) is not None, (
        "counted as recovered while ps-1 has not registered with the new coordinator")


def test_a_new_coordinator_that_no_server_has_registered_with_is_not_recovered():
    before = _status(generation=7, steps=306, servers=[_server("ps-0"), _server("ps-1")],
                     awaiting=[])
    kill = Kill(Target("coordinator", "", "coordinator"), at_step=306, killed_at=0.0,
                before=before)
    after = _status(generation=8, steps=312, servers=[], awaiting=[])
    assert missing_evidence(kill, after) is not None, (
        "counted as recovered with no server registered again")


def test_a_new_coordinator_with_every_server_registered_again_is_recovered():
    before = _status(generation=7, steps=306, servers=[_server("ps-0"), _server("ps-1")],
                     awaiting=[])
    kill = Kill(Target("coordinator", "", "coordinator"), at_step=306, killed_at=0.0,
                before=before)
    after = _status(generation=8, steps=312, servers=[_server("ps-0"), _server("ps-1")],
                    awaiting=[])
    assert missing_evidence(kill, after) is None
