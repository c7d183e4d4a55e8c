"""ps-ctl status as text: every line fits 80 columns, columns line up (placeholders too), long
ids and reasons are cut with an ellipsis, training and held-out figures are named apart; the
JSON keeps its keys; --watch refreshes until the job is over. No coordinator: a status as
CoordinatorClient.status() returns it."""

from __future__ import annotations

import io
import json

import pytest

from ps_worker import ctl
from ps_worker.ctl import Column, cut, render, table, watch

LONG_ID = "a-rather-long-hostname.cluster.example.internal-4242"
REASON = ("cannot run the job: model 'mymodule:build': cannot import 'mymodule': "
          "ModuleNotFoundError(\"No module named 'mymodule'\") " * 3)


def a_status(*, epochs: int = 3, mode: str = "ssp:2", auc: bool = True,
             state: str = "running") -> dict:
    """A crowded status: every section, long names, a dead worker with a long reason, an
    epoch not evaluated yet (placeholders)."""
    metrics = [{"epoch": e, "loss": 0.5 / e, "accuracy": 0.8 + e / 100,
                "test_loss": None if e == epochs else 0.45 / e,
                "test_accuracy": None if e == epochs else 0.79 + e / 100,
                "test_auc": 0.81 + e / 1000 if auc and e != epochs else None,
                "steps": 784, "examples": 25088} for e in range(1, epochs + 1)]
    return {
        "job": {"state": state, "epoch": epochs, "epochs": 30, "tasks_done": 25,
                "tasks_total": 270, "steps": 784 * epochs, "elapsed_s": 12.5,
                "failure": "task 12 (train, epoch 3) lost 5 workers; giving up " * 2
                if state == "failed" else "",
                "mode": mode, "staleness": {"max": 2}, "dropped_stale_gradients": 3,
                "spec": {"model": "embedding_mlp", "data": "synthetic_ctr"},
                "metrics": metrics},
        "workers": [
            {"id": "worker-0", "incarnation": 1882664434900402176, "state": "alive",
             "heartbeat_age_s": 0.2, "reason": "", "died_at_s": None, "tasks_done": 4,
             "steps": 176, "leased_tasks": [7], "data_path": "shm", "wait_s": 1.25},
            {"id": LONG_ID + "-a", "incarnation": 1882664434900402177, "state": "dead",
             "heartbeat_age_s": 12.04, "reason": REASON, "died_at_s": 3.0, "tasks_done": 1,
             "steps": 44, "leased_tasks": [], "data_path": "", "wait_s": 0.0},
            {"id": LONG_ID + "-b", "incarnation": 1882664434900402178, "state": "alive",
             "heartbeat_age_s": 0.4, "reason": "", "died_at_s": None, "tasks_done": 2,
             "steps": 88, "leased_tasks": [], "data_path": "shm+grpc", "wait_s": 0.5},
        ],
        "servers": [
            {"id": "ps-0", "address": "127.0.0.1:50061", "state": "alive",
             "heartbeat_age_s": 0.31, "bytes": 1234567, "shards": 3, "synced_epoch": 4,
             "state_losses": 1, "lost_shards": ["w/0", "b/0"],
             "loss_action": "restored from checkpoint ckpt-000000000007 (step 1234)"},
            {"id": "ps-1", "address": "ps-1.paramserve.default.svc.cluster.local:50061",
             "state": "alive", "heartbeat_age_s": 0.1, "bytes": 512, "shards": 1,
             "synced_epoch": 4, "state_losses": 0, "lost_shards": [], "loss_action": ""},
        ],
        "shard_map_epoch": 4, "generation": 1, "awaiting_servers": ["ps-2", "ps-3"],
        "checkpoint_dir": "/shared/checkpoints/of/a/job/with/a/long/path/" * 2,
        "last_checkpoint": {"id": "ckpt-000000000007", "step": 1234, "bytes": 4096000},
        "shards_restored": 2,
        "tables": [{"name": "items", "dim": 8, "num_rows": None, "capacity": 100000,
                    "ttl_seconds": 86400, "rows_held": 5000, "evictions": 12,
                    "bytes": 2000000}],
    }


def lines_under(text: str, first_header_word: str) -> tuple[str, list[str]]:
    """A table's header (the line whose first word is given) and its rows (up to a blank)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [first_header_word])
    rows = []
    for line in lines[start + 1:]:
        if not line.strip() or line.startswith("("):
            break
        rows.append(line)
    return lines[start], rows


def right_edges(header: str, names: list[str]) -> list[int]:
    return [header.index(name) + len(name) for name in names]


@pytest.mark.parametrize("state", ["running", "failed"])
def test_every_line_fits_80_columns(state):
    for status in (a_status(state=state), a_status(epochs=40, mode="async", auc=False,
                                                   state=state)):
        text = render(status)
        assert max(len(line) for line in text.splitlines()) <= 80, text
        assert "\t" not in text


def test_metric_columns_line_up_with_their_headers_placeholders_included():
    header, rows = lines_under(render(a_status()), "epoch")
    names = ["epoch", "train loss", "train acc", "held-out loss", "held-out acc",
             "held-out AUC", "steps"]
    edges = right_edges(header, names)
    assert len(rows) == 3
    for row in rows:  # right-aligned: every cell ends where its header ends
        for edge in edges:
            assert row[edge - 1] != " " and (edge == len(row) or row[edge] == " "), (row, edge)
    # The epoch not evaluated yet: a placeholder in each held-out column, where values go.
    assert [rows[2][edge - 1] for edge in edges[3:6]] == ["-", "-", "-"]
    assert rows[0].split() == ["1", "0.5000", "0.8100", "0.4500", "0.8000", "0.8110", "784"]


def test_worker_and_server_columns_line_up_and_long_ids_are_cut_in_the_middle():
    text = render(a_status())
    header, rows = lines_under(text, "worker")
    table_rows = [row for row in rows if not row.startswith("    ")]  # not a reason
    assert len(table_rows) == 3
    start = header.index("state")
    assert {row[start:].split()[0] for row in table_rows} == {"alive", "dead"}
    ids = [row.split()[0] for row in table_rows]
    assert ids[0] == "worker-0"
    # Cut with an ellipsis, keeping the end that tells the two apart.
    assert all("..." in i and len(i) < len(LONG_ID) for i in ids[1:])
    assert ids[1].endswith("-a") and ids[2].endswith("-b")
    edge = right_edges(header, ["heartbeat"])[0]
    assert all(row[:edge].endswith("s ago") for row in table_rows)
    data_path = header.index("data path")
    assert [row[data_path:].split()[0] for row in table_rows] == ["shm", "-", "shm+grpc"]
    # The reason of the dead worker: under its row, cut to 3 lines ending in an ellipsis.
    reason = [row for row in rows if row.startswith("    ")]
    assert reason[0].strip().startswith("reason: cannot run the job")
    assert len(reason) == 3 and reason[-1].endswith("...")
    server_header, servers = lines_under(text, "server")
    address = server_header.index("address")
    assert servers[0][address:].split()[0] == "127.0.0.1:50061"
    assert "..." in servers[1][address:].split()[0]


def test_the_job_block_shows_the_rate_and_a_long_failure_wraps_whole():
    text = render(a_status(state="failed"))
    assert "2352 in 12.5 s (188.2 steps/s)" in text
    assert ctl.steps_per_s({"steps": 100, "elapsed_s": 4.0}) == 25.0
    assert ctl.steps_per_s({"steps": 0, "elapsed_s": 0.0}) is None
    joined = " ".join(line.strip() for line in text.splitlines())
    assert "giving up task 12 (train, epoch 3) lost 5 workers; giving up" in joined
    assert "ps-2, ps-3" in text


def test_only_the_newest_epochs_are_listed_and_the_rest_is_said_to_be_elsewhere():
    text = render(a_status(epochs=40))
    _, rows = lines_under(text, "epoch")
    assert [int(row.split()[0]) for row in rows] == list(range(29, 41))
    assert "epochs 1 to 28 not shown" in text


def test_cut_keeps_what_tells_values_apart():
    assert cut("short", 10) == "short"
    assert cut("abcdefghijkl", 8) == "abcde..."
    assert cut("abcdefghijkl", 8, "middle") == "abc...kl"
    assert len(cut("x" * 100, 12, "middle")) == 12
    lines = table([Column("id", shrink_to=6, cut="middle"), Column("n", right=True)],
                  [["worker-0000001", "1"], ["worker-0000002", "22"]], width=14, indent=0)
    assert all(len(line) <= 14 for line in lines)
    assert [line.split()[0] for line in lines[1:]] == ["work...001", "work...002"]


def test_status_json_keeps_the_clients_keys(monkeypatch, capsys):
    status = a_status()

    class Client:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def status(self):
            return status

    monkeypatch.setattr(ctl, "CoordinatorClient", Client)
    assert ctl.main(["--coordinator", "127.0.0.1:1", "status", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == status


class Terminal(io.StringIO):
    def isatty(self):
        return True


def statuses(*states: str):
    sequence = iter([a_status(state=state) for state in states])
    return lambda: next(sequence)


def test_watch_refreshes_until_the_job_is_done_or_failed():
    piped, naps = io.StringIO(), []
    assert watch(statuses("running", "running", "done"), interval_s=2.5, out=piped,
                 sleep=naps.append) == 0
    assert naps == [2.5, 2.5]
    text = piped.getvalue()
    assert text.count("workers (3)") == 3 and text.count("-" * 80 + "\n") == 2
    assert "\033[" not in text
    assert watch(statuses("running", "failed"), interval_s=1, out=io.StringIO(),
                 sleep=naps.append) == 1


def test_watch_on_a_terminal_clears_the_screen_and_count_bounds_it():
    terminal = Terminal()
    assert watch(statuses("running", "running", "running"), interval_s=1, out=terminal,
                 count=2, sleep=lambda s: None) == 0
    text = terminal.getvalue()
    assert text.count(ctl.CLEAR_SCREEN) == 2 and text.count("workers (3)") == 2


def test_watch_as_json_prints_one_object_per_line():
    out = io.StringIO()
    assert watch(statuses("running", "done"), interval_s=1, out=out, as_json=True,
                 sleep=lambda s: None) == 0
    assert [json.loads(line)["job"]["state"] for line in out.getvalue().splitlines()] == [
        "running", "done"]


@pytest.mark.parametrize("argv", [["status", "--watch", "0"], ["status", "--count", "2"],
                                  ["status", "--watch", "1", "--count", "0"], ["status"]])
def test_bad_watch_flags_and_a_missing_coordinator_are_usage_errors(argv, capsys):
    if argv != ["status"]:
        argv = ["--coordinator", "127.0.0.1:1", *argv]
    with pytest.raises(SystemExit) as exit_:
        ctl.main(argv)
    assert exit_.value.code == 2
    assert "--" in capsys.readouterr().err
