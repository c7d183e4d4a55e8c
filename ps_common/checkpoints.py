"""The checkpoint format on disk: safetensors files per server, a ledger file per server, and
a manifest written last. Shared by servers (which write their shards and read rows back) and
the coordinator (which writes the manifest, picks the newest good checkpoint and prunes old
ones). No grpc here.

    DIR/ckpt-000000000007/
        ps-0.safetensors      tensors "<variable>/<index>" (values) and "<variable>/<index>/<slot>"
        ps-0.ledger.json      the server's exactly-once ledger, cut together with its values
        ...
        manifest.json         variables, shards (row ranges, files), checksums, job progress
        carried.ckpt-000000000003.ps-0.safetensors
                              a file of an older checkpoint (a hard link), for variables it
                              held that the job has not declared since (carry_forward)

A dynamic table's shard has the slots "ids" and "held" too (its pool's bookkeeping), and
"last_use_age" and "last_use_ago" (seconds and requests from each pool row's last use to the
cut; a checkpoint written before those were saved lacks them).

Every file is written to a temporary name, fsynced and renamed, and the manifest comes last:
a directory without a manifest is an unfinished checkpoint and is never read. Files are
written as they are produced (a shard at a time, never the whole server in memory) with
their sha256 computed on the way, and read back through a memory map, so restoring a few
rows of a large variable reads only those rows. The tensor files are plain safetensors:
`safetensors.numpy.load_file` and every tool built on it reads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ps_common.shardmap import DENSE, Component, VariableSpec, owners_of

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
ID_PREFIX = "ckpt-"
FORMAT = "paramserve-checkpoint"
VERSION = 1
# int64 and uint8: an embedding table's per-row adam steps, a dynamic table's ids and flags
# (and requests since each row's last use; float64 its age).
_SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64",
                       "uint8": "U8"}
_NUMPY_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
_HASH_BLOCK = 4 << 20


class CheckpointError(Exception):
    """A checkpoint is missing, unfinished, corrupt or does not fit what is asked of it."""


@dataclass(frozen=True)
class FileRecord:
    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardRecord:
    variable: str
    index: int
    row_start: int
    row_stop: int
    server_id: str
    file: str
    updates: int
    optimizer_steps: int
    stride: int = 1  # an embedding table's shard (ps_common.shardmap.Shard); 1: dense rows


@dataclass
class Manifest:
    id: str
    step: int
    epoch: int  # the shard-map epoch the checkpoint describes
    created_unix_s: float
    variables: dict[str, VariableSpec]
    shards: list[ShardRecord]
    files: dict[str, FileRecord]
    ledgers: dict[str, str] = field(default_factory=dict)  # server_id -> ledger file
    job: dict | None = None  # the job's progress when the checkpoint was taken
    directory: Path | None = None  # where it was read from (not stored)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files.values())

    def shards_of(self, variable: str) -> list[ShardRecord]:
        return sorted((s for s in self.shards if s.variable == variable),
                      key=lambda s: s.row_start)

    def to_json(self) -> str:
        doc = {
            "format": FORMAT, "version": VERSION, "id": self.id, "step": self.step,
            "epoch": self.epoch, "created_unix_s": self.created_unix_s,
            "variables": {n: spec_to_json(s) for n, s in self.variables.items()},
            "shards": [asdict(s) for s in self.shards],
            "files": {n: asdict(f) for n, f in self.files.items()},
            "ledgers": self.ledgers, "job": self.job,
        }
        return json.dumps({**doc, "sha256": _digest_of(doc)}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, directory: Path | None = None) -> "Manifest":
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict):
                raise CheckpointError(f"not a {FORMAT} manifest (a JSON {type(doc).__name__})")
            if doc.get("format") != FORMAT or doc.get("version") != VERSION:
                raise CheckpointError(f"not a {FORMAT} version {VERSION} manifest")
            if doc.pop("sha256", None) != _digest_of(doc):
                raise CheckpointError("the manifest does not match its sha256 checksum "
                                      "(altered or corrupt)")
            return cls(
                id=doc["id"], step=int(doc["step"]), epoch=int(doc["epoch"]),
                created_unix_s=float(doc["created_unix_s"]),
                variables={n: spec_from_json(s) for n, s in doc["variables"].items()},
                shards=[ShardRecord(**s) for s in doc["shards"]],
                files={n: FileRecord(**f) for n, f in doc["files"].items()},
                ledgers=dict(doc.get("ledgers", {})), job=doc.get("job"), directory=directory)
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"malformed manifest: {error}") from error


def _digest_of(doc: dict) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
                          ).hexdigest()


def spec_to_json(spec: VariableSpec) -> dict:
    return {"name": spec.name, "shape": list(spec.shape), "dtype": spec.dtype,
            # As declared, as older versions wrote them: they take a spec with its defaults
            # spelled out (or left out) for another one.
            "initializer": {"name": spec.initializer.name,
                            **dict(spec.written_initializer.params)},
            "optimizer": {"name": spec.optimizer.name, **dict(spec.written_optimizer.params)},
            "seed": spec.seed,
            # Dense variables' documents are as before embedding tables existed.
            **({} if not spec.is_table else {"kind": spec.kind, "capacity": spec.capacity,
                                             "ttl_seconds": spec.ttl_seconds})}


def spec_from_json(doc: dict) -> VariableSpec:
    return VariableSpec(doc["name"], tuple(int(d) for d in doc["shape"]), doc["dtype"],
                        Component.of(doc["initializer"]), Component.of(doc["optimizer"]),
                        int(doc["seed"]), doc.get("kind", DENSE), int(doc.get("capacity", 0)),
                        float(doc.get("ttl_seconds", 0.0)))


def values_name(variable: str, index: int) -> str:
    return f"{variable}/{index}"


def slot_name(variable: str, index: int, slot: str) -> str:
    return f"{variable}/{index}/{slot}"


# ---- writing -------------------------------------------------------------------------------

def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# A file being written is flushed to the disk each time this much more of it was written:
# the flush at its end then waits for at most this much, and a writer that watches for
# progress (ps_server.snapshots: --checkpoint-stall-timeout) sees some at least this often.
SYNC_EVERY_BYTES = 1 << 30


class _HashingFile:
    """A file being written under a temporary name; `commit` makes it durable and visible.
    `on_progress()` is called after each write, each flush to the disk and the commit."""

    def __init__(self, path: Path, on_progress=lambda: None):
        self.path = path
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        self._tmp = Path(tmp)
        self._file = os.fdopen(fd, "wb")
        self._hash = hashlib.sha256()
        self._bytes = 0
        self._synced = 0
        self._on_progress = on_progress

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._file.write(view)
        self._bytes += len(view)
        self._on_progress()
        if self._bytes - self._synced >= SYNC_EVERY_BYTES:
            self._file.flush()
            os.fdatasync(self._file.fileno())
            self._synced = self._bytes
            self._on_progress()

    def commit(self) -> FileRecord:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._on_progress()
        os.replace(self._tmp, self.path)
        fsync_directory(self.path.parent)
        self._on_progress()
        return FileRecord(self.path.name, self._bytes, self._hash.hexdigest())

    def abort(self) -> None:
        try:
            self._file.close()  # flushes what is buffered: on a full disk, that fails too
        except OSError:
            pass
        finally:
            self._tmp.unlink(missing_ok=True)


def write_file(path: Path, data: bytes, on_progress=lambda: None) -> FileRecord:
    """`data` in `path`, durably: a temporary name, fsync, rename, fsync of the directory."""
    out = _HashingFile(path, on_progress)
    try:
        out.write(data)
        return out.commit()
    except BaseException:
        out.abort()
        raise


def write_json(path: Path, doc, on_progress=lambda: None) -> FileRecord:
    return write_file(path, json.dumps(doc, sort_keys=True).encode(), on_progress)


class TensorFileWriter:
    """Streams a safetensors file: the header (every tensor's dtype and shape) first, then
    each tensor's bytes, in the order the tensors were listed, as `write` is called.
    `on_progress()`: see _HashingFile."""

    def __init__(self, path: Path, tensors: list[tuple[str, str, tuple[int, ...]]],
                 metadata: dict[str, str], on_progress=lambda: None):
        header: dict = {"__metadata__": metadata}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for name, dtype, shape in tensors:
            size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self._expected.append((name, size))
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
        self._out = _HashingFile(path, on_progress)
        self._out.write(struct.pack("<Q", len(encoded)) + encoded)
        self._next = 0

    def write(self, name: str, array: np.ndarray) -> None:
        self.begin(name)
        self.append(array)
        self.end()

    def begin(self, name: str) -> None:
        """Start the next tensor, whose bytes then come in `append` calls."""
        expected, _ = self._expected[self._next]
        if name != expected:
            raise ValueError(f"tensor {name!r} written where {expected!r} was announced")
        self._written = 0

    def append(self, array: np.ndarray) -> None:
        self._out.write(np.ascontiguousarray(array).view(np.uint8).reshape(-1))
        self._written += array.nbytes

    def end(self) -> None:
        expected, size = self._expected[self._next]
        if self._written != size:
            raise ValueError(f"tensor {expected!r}: {self._written} bytes written, {size} "
                             "announced")
        self._next += 1

    def commit(self) -> FileRecord:
        if self._next != len(self._expected):
            raise ValueError(f"{len(self._expected) - self._next} announced tensor(s) not written")
        return self._out.commit()

    def abort(self) -> None:
        self._out.abort()


# ---- reading -------------------------------------------------------------------------------

class TensorFile:
    """A safetensors file read through a memory map (only the rows asked for are read)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > 100 << 20:
                    raise CheckpointError(f"{path}: header of {length} bytes")
                self._header = json.loads(f.read(length))
            self._data_start = 8 + length
            self._size = path.stat().st_size
        except (OSError, ValueError, struct.error) as error:
            raise CheckpointError(f"cannot read {path}: {error}") from error

    def has(self, name: str) -> bool:
        return name in self._header

    def array(self, name: str) -> np.ndarray:
        entry = self._header.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        start, stop = entry["data_offsets"]
        dtype = np.dtype(_NUMPY_DTYPES[entry["dtype"]])
        shape = tuple(entry["shape"])
        if self._data_start + stop > self._size:
            raise CheckpointError(f"{self.path} is truncated (tensor {name!r})")
        if stop == start:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + start,
                         shape=shape)


def file_digest(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def verify_file(directory: Path, record: FileRecord) -> None:
    path = directory / record.name
    try:
        size, digest = file_digest(path)
    except OSError as error:
        raise CheckpointError(f"{path}: {error.strerror or error}") from error
    if size != record.bytes:
        raise CheckpointError(f"{path} has {size} bytes, the manifest says {record.bytes} "
                              "(truncated or overwritten)")
    if digest != record.sha256:
        raise CheckpointError(f"{path} does not match its sha256 checksum (altered or corrupt)")


def load_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST
    try:
        text = path.read_bytes().decode()
    except OSError as error:
        raise CheckpointError(f"{path}: {error.strerror or error}") from error
    except UnicodeDecodeError as error:  # bit rot, or not a manifest at all
        raise CheckpointError(f"{path}: not UTF-8 text ({error.reason} at byte "
                              f"{error.start}): corrupt") from error
    try:
        manifest = Manifest.from_json(text, directory)
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from error
    if manifest.id != directory.name:
        raise CheckpointError(f"{directory / MANIFEST} names checkpoint {manifest.id!r}")
    return manifest


def verify(directory: Path) -> Manifest:
    """The manifest, once every file it lists matches its size and checksum. A carried file
    that does not (shared with the checkpoint it came from: see carry_forward) takes only
    the variables carried in it out of the manifest, not the checkpoint's own."""
    manifest = load_manifest(directory)
    for record in list(manifest.files.values()):
        try:
            verify_file(directory, record)
        except CheckpointError as error:
            if not record.name.startswith(CARRIED_PREFIX):
                raise
            _drop_carried(manifest, record.name, str(error))
    return manifest


def _drop_carried(manifest: Manifest, file: str, why: str) -> None:
    """Take the variables carried in `file` out of `manifest` (in memory)."""
    lost = {r.variable for r in manifest.shards if r.file == file}
    log.error("checkpoint %s: %s; the variables carried in it (%s) are not restored from it",
              manifest.id, why, ", ".join(sorted(lost)))
    for name in lost:
        manifest.variables.pop(name, None)
    manifest.shards = [r for r in manifest.shards if r.variable not in lost]
    used = {r.file for r in manifest.shards}
    manifest.files = {n: f for n, f in manifest.files.items()
                      if n in used or not n.startswith(CARRIED_PREFIX)}


class RowSource:
    """Reads rows of variables from one checkpoint, verifying each file it opens once."""

    def __init__(self, directory: Path):
        self.manifest = load_manifest(directory)
        self.directory = directory
        self._files: dict[str, TensorFile] = {}

    def _file(self, name: str) -> TensorFile:
        if name not in self._files:
            record = self.manifest.files.get(name)
            if record is None:
                raise CheckpointError(f"{self.directory / MANIFEST} lists no file {name!r}")
            verify_file(self.directory, record)
            self._files[name] = TensorFile(self.directory / name)
        return self._files[name]

    def load(self, spec: VariableSpec, row_start: int, row_stop: int,
             slots: dict[str, np.ndarray], values: np.ndarray | None = None,
             ) -> tuple[np.ndarray, int, int]:
        """Rows [row_start, row_stop) of `spec`'s values (returned: `values` if given, else a
        new array) and of each slot (copied into `slots`, made by the caller with the right
        dtype and shape). Also returns the updates and the optimizer step count: the largest
        of the checkpointed shards read."""
        saved = self.manifest.variables.get(spec.name)
        if saved != spec:
            raise CheckpointError(f"checkpoint {self.manifest.id} holds {spec.name!r} as "
                                  f"{saved.describe() if saved else 'nothing'}, not "
                                  f"{spec.describe()}")
        if values is None:
            values = np.empty((row_stop - row_start, *spec.shape[1:]), dtype=spec.dtype)
        covered, updates, steps = 0, 0, 0
        for record in self.manifest.shards_of(spec.name):
            lo, hi = max(row_start, record.row_start), min(row_stop, record.row_stop)
            if lo >= hi:
                continue
            source = self._file(record.file)
            src = slice(lo - record.row_start, hi - record.row_start)
            dst = slice(lo - row_start, hi - row_start)
            values[dst] = source.array(values_name(spec.name, record.index))[src]
            for slot, target in slots.items():
                target[dst] = source.array(slot_name(spec.name, record.index, slot))[src]
            covered += hi - lo
            updates, steps = max(updates, record.updates), max(steps, record.optimizer_steps)
        if covered != row_stop - row_start:
            raise CheckpointError(f"checkpoint {self.manifest.id} covers {covered} of rows "
                                  f"{row_start}:{row_stop} of {spec.name!r}")
        return values, updates, steps

    def load_table(self, spec: VariableSpec, index: int, stride: int, slot_names: list[str],
                   optional: dict[str, np.generic] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], int, int]:
        """The rows of embedding table `spec` that belong to shard `index` of `stride`,
        from whichever checkpointed shards hold them (the checkpoint may have cut the table
        into another number of shards): (ids, values, slots, updates, optimizer steps).
        `optional` slots are read too where a shard has them; one written before they were
        saved gets their fill value (its dtype) on every row."""
        optional = optional or {}
        saved = self.manifest.variables.get(spec.name)
        if saved != spec:
            raise CheckpointError(f"checkpoint {self.manifest.id} holds {spec.name!r} as "
                                  f"{saved.describe() if saved else 'nothing'}, not "
                                  f"{spec.describe()}")
        ids, values, slots = [], [], {name: [] for name in [*slot_names, *optional]}
        updates, steps = 0, 0
        for record in self.manifest.shards_of(spec.name):
            source = self._file(record.file)
            saved_values = source.array(values_name(spec.name, record.index))
            saved_slots = {name: source.array(slot_name(spec.name, record.index, name))
                           for name in slot_names}
            for name, fill in optional.items():
                tensor = slot_name(spec.name, record.index, name)
                saved_slots[name] = (source.array(tensor) if source.has(tensor)
                                     else np.full(len(saved_values), fill))
            if spec.dynamic:
                saved_ids = np.asarray(saved_slots["ids"])
                mine = np.asarray(saved_slots["held"]).astype(bool) & (
                    owners_of(spec, saved_ids, stride) == index)
            else:
                saved_ids = np.arange(record.row_start, record.row_stop, record.stride)
                mine = owners_of(spec, saved_ids, stride) == index
            ids.append(saved_ids[mine])
            values.append(saved_values[mine])
            for name in slots:
                slots[name].append(saved_slots[name][mine])
            updates, steps = max(updates, record.updates), max(steps, record.optimizer_steps)
        if not ids:
            raise CheckpointError(f"checkpoint {self.manifest.id} holds no shard of "
                                  f"{spec.name!r}")
        return (np.concatenate(ids), np.concatenate(values),
                {name: np.concatenate(parts) for name, parts in slots.items()}, updates, steps)

    def ledger(self, server_id: str) -> dict | None:
        name = self.manifest.ledgers.get(server_id)
        if name is None:
            return None
        verify_file(self.directory, self.manifest.files[name])
        return json.loads((self.directory / name).read_text())


# ---- when to take one -----------------------------------------------------------------

@dataclass(frozen=True)
class Interval:
    """--checkpoint-every: `seconds` or `steps` (exactly one is set)."""

    seconds: float = 0.0
    steps: int = 0

    @classmethod
    def parse_flag(cls, text: str) -> "Interval | None":
        """--checkpoint-every's value: "off" (None: only on request and at the end) or an
        interval (ValueError naming the flag)."""
        return None if text.strip().lower() == "off" else cls.parse(text)

    @classmethod
    def parse(cls, text: str) -> "Interval":
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|sec|seconds?|m|min|steps?)?\s*", text)
        if not match:
            raise ValueError(f"--checkpoint-every {text!r}: expected seconds (e.g. 30s, 5m) "
                             "or steps (e.g. 500steps)")
        number, unit = float(match.group(1)), (match.group(2) or "s")
        if number <= 0:
            raise ValueError(f"--checkpoint-every {text!r} must be > 0")
        if unit.startswith("step"):
            if number != int(number):
                raise ValueError(f"--checkpoint-every {text!r}: steps must be a whole number")
            return cls(steps=int(number))
        return cls(seconds=number * (60 if unit.startswith("m") else 1))

    def describe(self) -> str:
        return f"{self.steps} steps" if self.steps else f"{self.seconds:g} s"


# ---- the checkpoint directory ----------------------------------------------------------

def checkpoint_ids(root: Path) -> list[str]:
    """Every checkpoint directory under `root`, oldest first (finished or not)."""
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir()
                  if p.is_dir() and p.name.startswith(ID_PREFIX) and p.name[len(ID_PREFIX):].isdigit())


def new_checkpoint_dir(root: Path) -> Path:
    """A new, empty checkpoint directory, numbered after every existing one."""
    root.mkdir(parents=True, exist_ok=True)
    ids = checkpoint_ids(root)
    number = int(ids[-1][len(ID_PREFIX):]) + 1 if ids else 1
    while True:
        path = root / f"{ID_PREFIX}{number:012d}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            number += 1


def newest_good(root: Path) -> tuple[Manifest | None, list[tuple[str, str]]]:
    """The newest finished checkpoint whose files all match their checksums, and the newer
    ones skipped, each with why."""
    skipped = []
    for cid in reversed(checkpoint_ids(root)):
        if not (root / cid / MANIFEST).exists():
            continue  # unfinished: never was a checkpoint
        try:
            return verify(root / cid), skipped
        except CheckpointError as error:
            skipped.append((cid, str(error)))
    return None, skipped


def prune(root: Path, keep: int, protect: str | Iterable[str] = ()) -> list[str]:
    """Delete all but the newest `keep` finished checkpoints, and unfinished ones older than
    the newest finished one (a crash left them). `protect` (ids) is never deleted. One that
    cannot be removed (its manifest: EACCES, EROFS) is logged and the others still go."""
    protected = {protect} if isinstance(protect, str) else set(protect)
    ids = checkpoint_ids(root)
    finished = [c for c in ids if (root / c / MANIFEST).exists()]
    keep_ids = set(finished[-keep:]) if keep > 0 else set()
    newest = finished[-1] if finished else ""
    removed = []
    for cid in ids:
        if cid in keep_ids or cid in protected or (cid not in finished and cid > newest):
            continue
        # The manifest goes first: a half-removed checkpoint is an unfinished one, never a
        # corrupt finished one.
        try:
            (root / cid / MANIFEST).unlink(missing_ok=True)
        except OSError as error:
            log.warning("cannot remove old checkpoint %s: %s", root / cid,
                        error.strerror or error)
            continue
        shutil.rmtree(root / cid, ignore_errors=True)
        removed.append(cid)
    return removed


CARRIED_PREFIX = "carried."


def carry_forward(previous: Manifest, directory: Path, declared
                  ) -> tuple[dict[str, VariableSpec], list[ShardRecord], dict[str, FileRecord]]:
    """(variables, shards, files) that a new checkpoint in `directory` takes over from
    `previous`: the variables it holds that are not `declared` now (a resumed job that
    declares them later restores their trained values from the newest checkpoint, not
    from initial values), their files linked into `directory` (copied where the file
    system has no hard links) under names that say where they came from. Their files are
    verified first: a file found altered is not carried."""
    variables = {name: spec for name, spec in previous.variables.items()
                 if name not in declared}
    # A file that no longer matches its checksum is not carried (nor what it holds): each
    # checkpoint's files were checked when it was written or found.
    bad = set()
    for file in {r.file for r in previous.shards if r.variable in variables}:
        try:
            verify_file(previous.directory, previous.files[file])
        except CheckpointError as error:
            log.error("checkpoint %s: %s; what it holds is not carried into %s", previous.id,
                      error, directory.name)
            bad.add(file)
    for record in previous.shards:
        if record.file in bad:
            variables.pop(record.variable, None)
    records = [r for r in previous.shards if r.variable in variables]
    names: dict[str, str] = {}
    files: dict[str, FileRecord] = {}
    for record in records:
        if record.file in names:
            continue
        name = (record.file if record.file.startswith(CARRIED_PREFIX)
                else f"{CARRIED_PREFIX}{previous.id}.{record.file}")
        source, target = previous.directory / record.file, directory / name
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)
            with open(target, "rb+") as copied:
                os.fsync(copied.fileno())
        names[record.file] = name
        files[name] = FileRecord(name, previous.files[record.file].bytes,
                                 previous.files[record.file].sha256)
    if files:
        fsync_directory(directory)
    return variables, [replace(r, file=names[r.file]) for r in records], files


def write_manifest(manifest: Manifest) -> None:
    assert manifest.directory is not None
    write_file(manifest.directory / MANIFEST, manifest.to_json().encode())

