"""The worker's data and user-model loading: a data file that cannot be read is
refused naming the file (a ValueError, which the worker reports to the coordinator), and a
user model of embedding tables alone loads (the trainer runs such a model)."""

from __future__ import annotations

import io
import struct
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

from ps_worker.data import load_dataset
from ps_worker.models import EmbeddingDef, build_model


def _member_data_offset(path: Path, member: str) -> int:
    """Where `member`'s (compressed) bytes start in the zip file at `path`."""
    with zipfile.ZipFile(path) as archive:
        header_offset = archive.getinfo(member).header_offset
    raw = path.read_bytes()
    name_length, extra_length = struct.unpack_from("<HH", raw, header_offset + 26)
    return header_offset + 30 + name_length + extra_length


def _corrupt_deflate_stream(tmp_path: Path) -> Path:
    """An .npz of savez_compressed whose 'x.npy' deflate stream starts with a block of the
    reserved type 3 (first byte 0xFF): its zip directory is intact, its data is not."""
    path = tmp_path / "corrupt.npz"
    rng = np.random.default_rng(0)
    np.savez_compressed(path, x=rng.normal(size=(64, 4)).astype(np.float32),
                        y=rng.integers(0, 3, 64))
    raw = bytearray(path.read_bytes())
    raw[_member_data_offset(path, "x.npy")] = 0xFF
    path.write_bytes(bytes(raw))
    return path


def _unbalanced_npy_header(tmp_path: Path) -> Path:
    """A well-formed zip (CRCs right) whose 'x.npy' header has its shape's closing
    parenthesis replaced by a space."""
    path = tmp_path / "bad_header.npz"
    members = {}
    for name, array in (("x", np.ones((64, 4), np.float32)), ("y", np.zeros(64, np.int64))):
        buffer = io.BytesIO()
        np.lib.format.write_array(buffer, array)
        members[name] = buffer.getvalue()
    assert b"(64, 4)" in members["x"]
    members["x"] = members["x"].replace(b"(64, 4)", b"(64, 4 ", 1)
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(f"{name}.npy", data)
    return path


@pytest.mark.parametrize("make", [_corrupt_deflate_stream, _unbalanced_npy_header],
                         ids=["corrupt-deflate-stream", "unbalanced-npy-header"])
def test_a_corrupt_npz_is_refused_naming_the_file(tmp_path: Path, make) -> None:
    """load_dataset raises ValueError naming the path when it cannot be loaded, which the
    worker reports. A damaged deflate stream raised zlib.error and a damaged .npy header
    tokenize.TokenError: the worker died with a traceback instead of reporting."""
    path = make(tmp_path)
    try:
        load_dataset(str(path))
    except ValueError as error:
        assert str(path) in str(error)
    except Exception as error:  # noqa: BLE001 - what the current code raises
        pytest.fail(f"load_dataset raised {type(error).__module__}.{type(error).__name__}: "
                    f"{error} (not a ValueError naming {str(path)!r})")
    else:
        pytest.fail("a corrupt .npz loaded")


class TablesOnly:
    """Matrix-factorization-like: one embedding table, no dense variable."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes

    def variables(self):
        return []

    def tables(self):
        return [EmbeddingDef("items", dim=2, num_rows=self.num_classes)]

    def row_ids(self, batch):
        return {"items": np.asarray(batch[1], np.int64)}

    def loss_and_grads(self, params, batch):
        rows = params["items"]
        return float((rows ** 2).sum() / len(rows)), {"items": 2 * rows / len(rows)}


def test_a_user_model_of_embedding_tables_alone_loads(monkeypatch) -> None:
    """A user model of tables alone (variables() an empty list) loads: the trainer runs it.
    It was refused because variables() was required to be non-empty before the tables'
    names were counted."""
    module = types.ModuleType("tables_only_user_model")
    module.TablesOnly = TablesOnly
    monkeypatch.setitem(sys.modules, module.__name__, module)
    model = build_model(f"{module.__name__}:TablesOnly", num_features=20, num_classes=4)
    assert [table.name for table in model.tables()] == ["items"]
