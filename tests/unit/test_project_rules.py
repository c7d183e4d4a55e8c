"""Project rules from STYLE.md that code review would otherwise have to remember.

Import rules are checked by parsing each file's own import statements with `ast` (nothing is
imported), so a rule broken in a module that is never imported by the tests is still caught.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OUR_PACKAGES = ("ps_proto", "ps_common", "ps_server", "ps_worker")

# Modules that hold domain logic: they must not touch grpc or generated protobuf types.
# Glob patterns relative to the repository root; each must match at least one file.
# Add new domain modules here (e.g. "ps_server/coordinator/jobs.py", "ps_worker/runtime.py").
DOMAIN_MODULES = [
    "ps_common/shardmap.py",
    "ps_common/errors.py",
    "ps_common/clock.py",
    "ps_server/store.py",
    "ps_server/optimizers.py",
    "ps_server/sparse_optimizers.py",
    "ps_server/dynamic_rows.py",
    "ps_server/footprint.py",
    "ps_common/rows.py",
    "ps_server/initializers.py",
    "ps_server/ledger.py",
    "ps_server/pushes.py",
    "ps_server/wire_gradients.py",
    "ps_server/consistency.py",
    "ps_common/consistency.py",
    "ps_server/buffers.py",
    "ps_server/coordinator/placement.py",
    "ps_server/coordinator/state.py",
    "ps_server/coordinator/jobs.py",
    "ps_server/coordinator/status_watchers.py",
    "ps_server/coordinator/persistence.py",
    "ps_server/coordinator/checkpointer.py",
    "ps_common/checkpoints.py",
    "ps_server/snapshots.py",
    "ps_server/restore.py",
    "ps_server/coordinator/identity.py",
    "ps_server/control.py",
    "ps_server/memory.py",
    "ps_common/malloc.py",
    "ps_server/streams.py",
    "ps_common/job.py",
    "ps_common/progress.py",
    "ps_common/tf_config.py",
    "ps_worker/runtime.py",
    "ps_worker/data.py",
    "ps_worker/metrics.py",
    "ps_worker/backend.py",
    "ps_worker/models/*.py",
]

# Top-level modules that mean "wire types": grpc and its add-ons, protobuf, our generated code.
WIRE_TOP_LEVEL = ("grpc", "grpc_status", "grpc_health", "grpc_reflection", "grpc_tools",
                  "ps_proto")
WIRE_PREFIXES = ("google.protobuf", "google.rpc")

CUPY_MODULE = "ps_worker/_cupy_backend.py"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module a source file imports, absolute, including lazy (function-level) imports
    and `importlib.import_module("literal")` calls. For `from a import b`, both `a` and `a.b`
    are listed (b may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".") if package else []
                if node.level > 1:
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base:
                found.add(base)
            found.update(f"{base}.{alias.name}" if base else alias.name
                         for alias in node.names if alias.name != "*")
        elif isinstance(node, ast.Call):
            func = node.func
            name = (func.attr if isinstance(func, ast.Attribute)
                    else func.id if isinstance(func, ast.Name) else "")
            if (name in ("import_module", "__import__") and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                found.add(node.args[0].value)
    return found


def top(name: str) -> str:
    return name.split(".")[0]


def is_wire(name: str) -> bool:
    return (top(name) in WIRE_TOP_LEVEL or name.startswith(WIRE_PREFIXES)
            or name.split(".")[-1].endswith(("_pb2", "_pb2_grpc")))


def package_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imports_of(path: Path) -> set[str]:
    return imported_modules(path.read_text(encoding="utf-8"), module_name(path),
                            is_package=path.name == "__init__.py")


def violations(package: str, bad) -> list[str]:
    out = []
    for path in package_files(package):
        for name in sorted(imports_of(path)):
            if bad(name):
                out.append(f"{path.relative_to(ROOT)} imports {name}")
    return out


# ---- the checker itself ---------------------------------------------------------------------

def test_import_scanner_resolves_every_form():
    source = """
import os, grpc
import ps_proto.v1.tensor_pb2 as t
from ps_common import errors
from . import sibling
from .sub import thing
from .. import uncle
from ..other.mod import x

def lazy():
    import cupy
    from ps_worker import _cupy_backend
    importlib.import_module("cupyx")
"""
    found = imported_modules(source, "ps_server.coordinator.state")
    for name in ["os", "grpc", "ps_proto.v1.tensor_pb2", "ps_common", "ps_common.errors",
                 "ps_server.coordinator", "ps_server.coordinator.sibling",
                 "ps_server.coordinator.sub", "ps_server.coordinator.sub.thing",
                 "ps_server", "ps_server.uncle", "ps_server.other.mod",
                 "ps_server.other.mod.x", "cupy", "ps_worker._cupy_backend", "cupyx"]:
        assert name in found, name
    # in a package's __init__, "." is the package itself
    assert "ps_worker.client" in imported_modules("from .client import PSClient",
                                                  "ps_worker", is_package=True)
    assert is_wire("grpc") and is_wire("ps_proto.v1.tensor_pb2") and is_wire("x.y_pb2_grpc")
    assert is_wire("google.protobuf.any_pb2") and not is_wire("numpy")


def test_every_package_exists_and_parses():
    for package in OUR_PACKAGES:
        files = package_files(package)
        assert files, package
        for path in files:
            imports_of(path)  # a syntax error fails here
    # the scan sees real imports (guards against a checker that silently finds nothing)
    assert violations("ps_server", lambda n: top(n) == "ps_common")
    assert "cupy" in imports_of(ROOT / CUPY_MODULE)


# ---- generated code -------------------------------------------------------------------------

def test_generated_protos_are_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_gen_protos_check_does_not_depend_on_path():
    plugin_dirs = {d for d in os.environ.get("PATH", "").split(os.pathsep)
                   if d and (Path(d) / "protoc-gen-mypy").exists()}
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d not in plugin_dirs)
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": path},
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---- who may import whom ------------------------------------------------------------------

def test_ps_proto_imports_nothing_of_ours():
    assert violations("ps_proto", lambda n: top(n) in ("ps_common", "ps_server", "ps_worker")) == []


def test_ps_common_imports_only_ps_proto_of_ours():
    assert violations("ps_common", lambda n: top(n) in ("ps_server", "ps_worker")) == []


def test_ps_server_never_imports_ps_worker():
    assert violations("ps_server", lambda n: top(n) == "ps_worker") == []


def test_ps_worker_never_imports_ps_server():
    assert violations("ps_worker", lambda n: top(n) == "ps_server") == []


@pytest.mark.parametrize("pattern", DOMAIN_MODULES)
def test_domain_modules_import_neither_grpc_nor_protobuf(pattern):
    matched = sorted(ROOT.glob(pattern))
    assert matched, f"DOMAIN_MODULES entry {pattern!r} matches no file"
    bad = [f"{p.relative_to(ROOT)} imports {n}" for p in matched for n in sorted(imports_of(p))
           if is_wire(n)]
    assert bad == []


def test_cupy_is_imported_in_exactly_one_module():
    importers = []
    for package in OUR_PACKAGES:
        for path in package_files(package):
            if any(top(n) in ("cupy", "cupyx") for n in imports_of(path)):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == [CUPY_MODULE]


def test_outside_the_coordinator_package_only_testing_imports_it():
    """docs/architecture.md, section 3: "Outside `coordinator/`, only `testing.py` imports the
    coordinator": the parameter-server daemon does not load the coordinator's code."""
    importers = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "ps_server").glob("*.py")
        if any(name == "ps_server.coordinator" or name.startswith("ps_server.coordinator.")
               for name in imports_of(path)))
    assert importers == ["ps_server/testing.py"]
