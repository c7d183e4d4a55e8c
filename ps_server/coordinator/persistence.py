"""The coordinator's state on disk: one JSON file, replaced atomically and checked on load.

A save writes a temporary file next to the state file (named `.<name>.<random>.tmp`), fsyncs
it, renames it onto the state file and fsyncs the directory, so that after a crash the path
holds either the previous state or the new one, never a mix. The file carries a sha256 of
its state's canonical JSON, so a torn or altered file is detected on load rather than
resumed from. No grpc here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def _canonical(state: dict) -> str:
    return json.dumps(state, sort_keys=True, separators=(",", ":"))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class StateFile:
    """Thread-safe: saves (and loads) are serialized by one lock, so the file always holds
    whole the state of the last save() to take it. Callers saving from several threads must
    order their export-and-save themselves if an older state must never follow a newer one.

    save() raises OSError when the write fails (the previous state stays in place) and
    ValueError for a state whose checksum would not survive JSON (e.g. int keys). load()
    never raises for a bad file: it logs a warning and returns None, so the coordinator starts
    fresh instead of crashing."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._temp_prefix, self._temp_suffix = f".{self.path.name}.", ".tmp"
        self._lock = threading.Lock()

    def save(self, state: dict) -> None:
        body = _canonical(state)
        if _canonical(json.loads(body)) != body:  # the checksum would not match on load
            raise ValueError("state is not JSON-ready: its canonical JSON changes in a round "
                             "trip (non-str keys?)")
        text = f'{{"sha256":"{_sha256(body)}","state":{body}}}'
        directory = self.path.parent
        with self._lock:
            fd, temp = tempfile.mkstemp(prefix=self._temp_prefix, suffix=self._temp_suffix,
                                        dir=directory)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(temp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
                raise
            # The rename is durable only once the directory entry is on disk.
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)

    def load(self) -> dict | None:
        """The saved state, or None when there is none or it cannot be trusted (warned).
        Removes temporary files left by a save that crashed."""
        with self._lock:
            self._remove_leftovers()
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                return None
            except OSError as e:
                self._warn(f"cannot be read ({e})")
                return None
            try:
                document = json.loads(raw)
                state, checksum = document["state"], document["sha256"]
            except (ValueError, TypeError, KeyError) as e:  # UnicodeDecodeError is a ValueError
                self._warn(f"is not a state file ({type(e).__name__}: {e})")
                return None
            if not isinstance(state, dict) or _sha256(_canonical(state)) != checksum:
                self._warn("does not match its checksum (torn or altered)")
                return None
            return state

    def _warn(self, problem: str) -> None:
        log.warning("coordinator state file %s %s; ignoring it and starting fresh",
                    self.path, problem)

    def _remove_leftovers(self) -> None:
        try:
            entries = list(self.path.parent.iterdir())
        except OSError:
            return  # no directory (then no state file either) or unreadable: load() says so
        for leftover in entries:
            if not (leftover.name.startswith(self._temp_prefix)
                    and leftover.name.endswith(self._temp_suffix)):
                continue
            try:
                leftover.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:  # not worth failing a start for
                log.warning("cannot remove leftover temporary state file %s: %s", leftover, e)
