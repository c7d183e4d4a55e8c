"""StateFile: the coordinator's state on disk, replaced atomically and refused when damaged."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from ps_server.coordinator.persistence import StateFile

STATE = {"version": 1, "epoch": 2, "steps": 123456, "loss": 0.25, "done": False,
         "failure": "", "tasks": [{"task_id": 9, "holder": ["w0", 17], "metrics": None}]}


@pytest.fixture
def state_file(tmp_path) -> StateFile:
    return StateFile(tmp_path / "coordinator-state.json")


def warnings_naming(caplog, path) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and str(path) in r.getMessage()]


def test_save_then_load_round_trips(state_file):
    state_file.save(STATE)
    assert state_file.load() == STATE
    assert StateFile(state_file.path).load() == STATE  # as a restarted process reads it


def test_a_second_save_replaces_the_first(state_file):
    state_file.save(STATE)
    state_file.save({**STATE, "epoch": 3})
    assert state_file.load()["epoch"] == 3


def test_a_missing_file_loads_as_none_without_a_warning(state_file, caplog):
    assert state_file.load() is None
    assert warnings_naming(caplog, state_file.path) == []


def test_a_truncated_file_loads_as_none_with_a_warning(state_file, caplog):
    state_file.save(STATE)
    raw = state_file.path.read_bytes()
    state_file.path.write_bytes(raw[:len(raw) // 2])
    with caplog.at_level(logging.WARNING):
        assert state_file.load() is None
    assert len(warnings_naming(caplog, state_file.path)) == 1


def test_a_file_with_one_altered_byte_loads_as_none_with_a_warning(state_file, caplog):
    state_file.save(STATE)
    raw = state_file.path.read_bytes()
    at = raw.index(b"123456")
    state_file.path.write_bytes(raw[:at] + b"9" + raw[at + 1:])  # still valid JSON
    with caplog.at_level(logging.WARNING):
        assert state_file.load() is None
    assert len(warnings_naming(caplog, state_file.path)) == 1


@pytest.mark.parametrize("content", [b"", b"[1, 2]", b'{"state": {}}', b"\xff\xfe\x00"])
def test_files_that_are_not_state_files_load_as_none(state_file, caplog, content):
    state_file.path.write_bytes(content)
    with caplog.at_level(logging.WARNING):
        assert state_file.load() is None
    assert len(warnings_naming(caplog, state_file.path)) == 1


def test_load_removes_temporary_files_left_by_a_crashed_save(state_file, tmp_path):
    state_file.save(STATE)
    # The documented name of a save's temporary file: .<state file name>.<random>.tmp
    (tmp_path / ".coordinator-state.json.k3j2h1.tmp").write_text('{"half": ')
    (tmp_path / "notes.txt").write_text("not ours")
    assert state_file.load() == STATE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coordinator-state.json", "notes.txt"]


def test_the_directory_holds_only_the_state_file_after_saves(state_file, tmp_path):
    for epoch in range(5):
        state_file.save({**STATE, "epoch": epoch})
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator-state.json"]


def test_a_failed_save_leaves_the_previous_state_and_no_temporary_file(state_file, tmp_path,
                                                                       monkeypatch):
    state_file.save(STATE)

    def replace_fails(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", replace_fails)
    with pytest.raises(OSError):
        state_file.save({**STATE, "epoch": 3})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator-state.json"]
    assert state_file.load() == STATE


def test_a_state_that_json_would_change_is_refused_at_save(state_file):
    with pytest.raises(ValueError):
        state_file.save({9: "int keys come back as str keys,", 10: "sorted otherwise"})
    assert not state_file.path.exists()


def test_concurrent_saves_leave_one_whole_state(state_file, tmp_path):
    def save_many(writer: int) -> None:
        for n in range(20):
            state_file.save({**STATE, "writer": writer, "n": n})

    threads = [threading.Thread(target=save_many, args=(i,), name=f"saver-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    loaded = state_file.load()
    assert loaded is not None and loaded["n"] == 19 and loaded["writer"] in range(4)
    assert [p.name for p in tmp_path.iterdir()] == ["coordinator-state.json"]
