"""A checkpoint whose manifest is corrupt or foreign in ways other than a JSON text that
fails its checksum (a byte with its high bit flipped, a JSON document that is not an object)
is detected and skipped, as every other corrupt file is; a server that finds it so while
restoring reports the checkpoint unreadable, naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from ps_common.checkpoints import (
    MANIFEST, CheckpointError, Manifest, ShardRecord, load_manifest, newest_good,
    write_manifest,
)
from ps_common.shardmap import Shard, VariableSpec
from ps_server.ledger import PushLedger
from ps_server.restore import ShardRestore
from ps_server.snapshots import save
from ps_server.store import ShardStore

SPEC = VariableSpec("w", (4, 2))


def take(root: Path, number: int, value: float) -> Path:
    """A complete one-server checkpoint `ckpt-<number>` of `w` (every value `value`)."""
    store = ShardStore()
    store.assign(1, {"w": SPEC}, [Shard("w", 0, 0, 4, "s")])
    (held,) = store.held()
    held.values[...] = value
    held.updates = 1
    directory = root / f"ckpt-{number:012d}"
    directory.mkdir(parents=True)
    outcome = save(store, PushLedger(), directory, "s", epoch=1)
    (saved,) = outcome.shards
    write_manifest(Manifest(
        id=directory.name, step=number, epoch=1, created_unix_s=0.0, variables={"w": SPEC},
        shards=[ShardRecord("w", 0, 0, 4, "s", saved.file, saved.updates,
                            saved.optimizer_steps)],
        files={f.name: f for f in outcome.files}, ledgers={"s": "s.ledger.json"},
        directory=directory))
    return directory


def flip_a_high_bit(path: Path) -> None:
    """One bit of a byte in the middle of the file (bit rot: an ASCII byte becomes >= 0x80)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x80
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", ["high-bit", "not-an-object"])
def test_a_corrupt_or_foreign_manifest_is_skipped_for_the_previous_good_checkpoint(
        tmp_path, corrupt):
    """The newest checkpoint's manifest is corrupt: newest_good returns the one before it and
    says why. A manifest that was not UTF-8 (one flipped high bit) raised UnicodeDecodeError,
    and one that was JSON but not an object (`[]`, a foreign file) AttributeError, out of
    newest_good, which the coordinator calls when it starts."""
    good = take(tmp_path, 1, 1.0)
    bad = take(tmp_path, 2, 2.0)
    if corrupt == "high-bit":
        flip_a_high_bit(bad / MANIFEST)
    else:
        (bad / MANIFEST).write_text("[]")

    manifest, skipped = newest_good(tmp_path)

    assert manifest is not None and manifest.id == good.name
    assert [cid for cid, _ in skipped] == [bad.name]
    assert MANIFEST in skipped[0][1] or "manifest" in skipped[0][1]


def test_load_manifest_raises_checkpoint_error_naming_the_file_for_undecodable_bytes(tmp_path):
    """A corrupt file is refused with a message naming it (CheckpointError, which every
    caller, coordinator and server, handles)."""
    bad = take(tmp_path, 1, 1.0)
    flip_a_high_bit(bad / MANIFEST)
    with pytest.raises(CheckpointError) as caught:
        load_manifest(bad)
    assert str(bad / MANIFEST) in str(caught.value)


def test_a_server_restoring_from_a_manifest_corrupted_since_it_was_checked_reports_it(
        tmp_path):
    """The server's ShardRestore gives up with `unreadable` set and a message naming the
    manifest, which makes the coordinator fall back to the previous good checkpoint (it
    failed with INTERNAL, and the coordinator sent the same restore again for ever)."""
    take(tmp_path, 1, 1.0)
    bad = take(tmp_path, 2, 2.0)
    flip_a_high_bit(bad / MANIFEST)
    shard = Shard("w", 0, 0, 4, "s")
    restore = ShardRestore(bad, {shard.key})
    restore.prepare({"w": SPEC}, [shard], set())
    assert restore.unreadable
    assert not restore.created
    assert MANIFEST in restore.error, restore.error
