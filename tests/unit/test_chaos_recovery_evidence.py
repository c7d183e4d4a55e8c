"""What `ps-cluster --chaos` counts as recovery from the coordinator's kill: a coordinator of
a new generation with every server of the status before the kill registered with it again
and alive, or that took the job to its end (README, Chaos run). A restarted coordinator lists in `servers` only the servers
that have registered with it; one of the recovered shard map that has not yet is in
`awaiting_servers` (ps-ctl status: "awaiting ... (held shards before the coordinator
restarted)"), not in `servers`."""

from __future__ import annotations

import pytest

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


def _coordinator_killed() -> Kill:
    """The kill of generation 7's coordinator, whose status showed ps-0 and ps-1 alive."""
    before = _status(generation=7, steps=306, servers=[_server("ps-0"), _server("ps-1")],
                     awaiting=[])
    return Kill(Target("coordinator", "", "coordinator"), at_step=306, killed_at=0.0,
                before=before)


@pytest.mark.parametrize("servers, awaiting", [
    # ps-0 registered again, ps-1 not yet; a worker's task finished meanwhile (the data path
    # never passes through the coordinator).
    (["ps-0"], ["ps-1"]),
    ([], []),  # no server registered again
], ids=["awaiting-ps-1", "none-registered"])
def test_a_new_coordinator_without_every_server_registered_again_is_not_recovered(
        servers, awaiting):
    after = _status(generation=8, steps=312, servers=[_server(s) for s in servers],
                    awaiting=awaiting)
    assert missing_evidence(_coordinator_killed(), after) is not None, (
        f"counted as recovered with servers {servers} registered again")


def test_a_new_coordinator_with_every_server_registered_again_is_recovered():
    after = _status(generation=8, steps=312, servers=[_server("ps-0"), _server("ps-1")],
                    awaiting=[])
    assert missing_evidence(_coordinator_killed(), after) is None


def test_a_new_coordinator_whose_servers_were_told_the_job_is_over_is_recovered():
    """The job ended soon after the restart: the servers registered with the new coordinator
    and were told the job is over before any status showed them alive."""
    after = _status(generation=8, steps=400, servers=[dict(_server("ps-0"), state="done"),
                                                      dict(_server("ps-1"), state="done")],
                    awaiting=[])
    after["job"]["state"] = "done"
    assert missing_evidence(_coordinator_killed(), after) is None


def test_a_server_the_new_coordinator_lost_is_not_recovered():
    after = _status(generation=8, steps=312,
                    servers=[_server("ps-0"), dict(_server("ps-1"), state="dead")], awaiting=[])
    assert missing_evidence(_coordinator_killed(), after) is not None


def test_a_new_coordinator_that_took_the_job_to_its_end_is_recovered():
    """Workers train on while the coordinator is down and report their tasks to the new one
    at once: near the end of a job it may be done before any server has heartbeated to it."""
    after = _status(generation=8, steps=400, servers=[], awaiting=["ps-0", "ps-1"])
    after["job"]["state"] = "done"
    assert missing_evidence(_coordinator_killed(), after) is None
    after["generation"] = 7  # the killed one's: not the evidence of a restart
    assert missing_evidence(_coordinator_killed(), after) is not None
