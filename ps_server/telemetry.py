"""What the parameter server and the coordinator tell Prometheus, read when it scrapes.

Both collectors read state the daemons keep anyway (ps_common.telemetry has the endpoint
and the per-call figures): nothing here runs on a pull or a push. Every read takes the
locks the daemon's own status reads take, for as long as they do.
"""

from __future__ import annotations

import time

from prometheus_client.core import (
    CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, SummaryMetricFamily,
)

# The states ps-ctl status shows; each gets a series, 0 when no member is in it, so that a
# state's series does not appear and vanish as members move.
SERVER_STATES = ("alive", "dead", "lost", "done")
WORKER_STATES = ("alive", "dead", "done")
JOB_STATES = ("none", "running", "done", "failed")


def _name(short: str) -> str:
    return f"paramserve_{short}"


class ServerCollector:
    """A parameter server's state: pushes applied and deduplicated (its exactly-once ledger),
    the consistency steps (staleness, waits, late gradients dropped), shards and bytes held,
    embedding tables' rows and evictions. `server` is a ps_server.app.ParameterServer."""

    def __init__(self, server):
        self._server = server

    def collect(self):
        server = self._server
        yield InfoMetricFamily(_name("server"), "This parameter server",
                               value={"server_id": server.server_id,
                                      "data_path": server.data_path})
        applied, duplicates = server.ledger.counts()
        yield CounterMetricFamily(
            _name("pushes_applied"), "Pushes applied, each once (recorded in the "
            "exactly-once ledger; in sync, each gradient of an averaged step)", value=applied)
        yield CounterMetricFamily(
            _name("pushes_deduplicated"), "Pushes found applied already and not applied "
            "again (retries whose first answer was lost)", value=duplicates)
        yield GaugeMetricFamily(
            _name("exactly_once_clients"), "Clients whose exactly-once state this server "
            "holds", value=server.ledger.live_clients())
        held = server.store.held()
        yield GaugeMetricFamily(_name("shards"), "Shards this server holds", value=len(held))
        yield GaugeMetricFamily(
            _name("shard_bytes"), "Bytes of values and optimizer slots this server holds",
            value=server.store.nbytes())
        yield GaugeMetricFamily(
            _name("memory_budget_bytes"), "This server's --memory-budget (0: no limit)",
            value=server.memory_budget_bytes)
        rows = GaugeMetricFamily(_name("table_rows"), "Rows of an embedding table this "
                                 "server holds", labels=["variable"])
        evictions = CounterMetricFamily(_name("table_evictions"), "Rows of a dynamic "
                                        "embedding table evicted (capacity or ttl)",
                                        labels=["variable"])
        tables: dict[str, list[int]] = {}
        for table in server.store.table_stats():
            totals = tables.setdefault(table.variable, [0, 0])
            totals[0] += table.rows
            totals[1] += table.evictions
        for variable, (held_rows, evicted) in sorted(tables.items()):
            rows.add_metric([variable], held_rows)
            evictions.add_metric([variable], evicted)
        yield rows
        yield evictions
        steps = server.steps.stats()
        yield GaugeMetricFamily(_name("step_members"), "Clients taking part in this "
                                "server's steps (ssp:K, sync)", value=steps.members)
        yield GaugeMetricFamily(
            _name("step_staleness_max"), "The largest gap in steps between a client and the "
            "slowest one that this server let through (ssp:K)", value=steps.staleness_max)
        yield CounterMetricFamily(
            _name("step_dropped_stale"), "Gradients dropped because their step had been "
            "applied already (sync)", value=steps.dropped_stale)
        yield CounterMetricFamily(_name("sync_steps"), "Averaged steps applied (sync; a "
                                  "step refused whole is not counted)", value=steps.applied)
        yield SummaryMetricFamily(
            _name("step_wait_seconds"), "Time stepped pushes waited for other clients "
            "before they were answered (ssp:K, sync)", count_value=steps.waits,
            sum_value=steps.waited_s)


class CoordinatorCollector:
    """The coordinator's view: members by role and state, the job's progress, steps and
    steps/s, and the newest checkpoint. `coordinator` is a ps_server.coordinator.app
    Coordinator."""

    def __init__(self, coordinator, clock=time.time):
        self._coordinator = coordinator
        self._clock = clock

    def collect(self):
        coordinator = self._coordinator
        members = GaugeMetricFamily(
            _name("members"), "Members the coordinator knows, by role and state (clients: "
            "PSClient instances holding an incarnation, the workers' own included)",
            labels=["role", "state"])
        servers = dict.fromkeys(SERVER_STATES, 0)
        for _, state, _ in coordinator.state.server_states():
            servers[state] = servers.get(state, 0) + 1
        for state, count in servers.items():
            members.add_metric(["server", state], count)
        snap = coordinator.runner.snapshot()
        workers = dict.fromkeys(WORKER_STATES, 0)
        for worker in snap["workers"]:
            workers[worker["state"]] = workers.get(worker["state"], 0) + 1
        for state, count in workers.items():
            members.add_metric(["worker", state], count)
        # A ps-worker's PSClient takes its worker's incarnation instead of asking for one:
        # the live workers' clients are counted with them.
        members.add_metric(["client", "alive"],
                           coordinator.clients.live_count() + workers.get("alive", 0))
        yield members
        job_state = GaugeMetricFamily(
            _name("job_state"), "1 for the job's state, 0 for the others (none: the "
            "coordinator runs no job)", labels=["state"])
        for state in JOB_STATES:
            job_state.add_metric([state], float(snap["state"].value == state))
        yield job_state
        tasks_total, tasks_done = snap["tasks_total"], snap["tasks_done"]
        yield GaugeMetricFamily(_name("job_tasks"), "Tasks of the job (training and "
                                "evaluation, every epoch)", value=tasks_total)
        yield CounterMetricFamily(_name("job_tasks_done"), "Tasks of the job done",
                                  value=tasks_done)
        yield GaugeMetricFamily(_name("job_progress_ratio"), "Tasks done / tasks of the job",
                                value=tasks_done / tasks_total if tasks_total else 0.0)
        yield GaugeMetricFamily(_name("job_epoch"), "The epoch being trained (1-based)",
                                value=snap["epoch"])
        yield GaugeMetricFamily(_name("job_epochs"), "Epochs of the job", value=snap["epochs"])
        yield GaugeMetricFamily(
            _name("job_waiting_leases"), "Workers waiting at the coordinator for a task to run "
            "(idle: the epoch's last tasks run elsewhere, or its evaluation has not pulled its "
            "parameters yet)",
            value=coordinator.runner.waiting_leases)
        yield CounterMetricFamily(_name("job_steps"), "Training steps of the job's tasks "
                                  "done", value=snap["steps"])
        elapsed = snap["elapsed_s"]
        yield GaugeMetricFamily(
            _name("job_steps_per_second"), "Steps per second since the job started (as in "
            "the job's summary; rate(paramserve_job_steps_total[1m]) gives the recent rate)",
            value=snap["steps"] / elapsed if elapsed > 0 else 0.0)
        checkpointer = coordinator.checkpointer
        manifest = checkpointer.catalog.current() if checkpointer is not None else None
        if manifest is not None:  # none before the first one (or without --checkpoint-dir)
            yield GaugeMetricFamily(
                _name("checkpoint_age_seconds"), "Seconds since the newest good checkpoint "
                "was taken", value=max(0.0, self._clock() - manifest.created_unix_s))
            yield GaugeMetricFamily(
                _name("checkpoint_timestamp_seconds"), "When the newest good checkpoint was "
                "taken (Unix time)", value=manifest.created_unix_s)
            yield GaugeMetricFamily(_name("checkpoint_step"), "The job's steps in the newest "
                                    "good checkpoint", value=manifest.step)
