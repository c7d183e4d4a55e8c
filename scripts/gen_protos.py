"""Generate ps_proto/ from protos/: the one way to run protoc in this project.

    python scripts/gen_protos.py          # regenerate ps_proto/ in place
    python scripts/gen_protos.py --check  # regenerate into a temp dir, diff, exit 1 if stale

The proto folder layout equals the Python import path (protos/ps_proto/v1/x.proto ->
ps_proto.v1.x_pb2), so generated imports need no rewriting.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUTPUT_PACKAGE = "ps_proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def _generate(out_dir: Path) -> None:
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    # The mypy plugins come from this interpreter's environment, not from whatever PATH has.
    scripts = Path(sysconfig.get_path("scripts"))
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"--plugin=protoc-gen-mypy={scripts / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={scripts / 'protoc-gen-mypy_grpc'}",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    subprocess.run(cmd, check=True, cwd=PROTO_ROOT)
    for package_dir in [out_dir / OUTPUT_PACKAGE, *(out_dir / OUTPUT_PACKAGE).rglob("*")]:
        if package_dir.is_dir():
            (package_dir / "__init__.py").touch()


def _generated_files(root: Path) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in (root / OUTPUT_PACKAGE).rglob("*")
        if p.name.endswith(GENERATED_SUFFIXES)
    }


def check() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        _generate(fresh)
        expected, actual = _generated_files(fresh), _generated_files(ROOT)
        stale = sorted(expected ^ actual)
        stale += sorted(
            f for f in expected & actual
            if not filecmp.cmp(fresh / f, ROOT / f, shallow=False)
        )
        if stale:
            print("ps_proto/ is stale; run `python scripts/gen_protos.py`:", *stale, sep="\n  ")
            return 1
        print("ps_proto/ is up to date")
        return 0


def regenerate() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        _generate(fresh)
        for stale in _generated_files(ROOT):
            (ROOT / stale).unlink()
        for rel in _generated_files(fresh):
            (ROOT / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(fresh / rel, ROOT / rel)
            init = (ROOT / rel).parent / "__init__.py"
            init.touch()
    print(f"regenerated {OUTPUT_PACKAGE}/ from {PROTO_ROOT.relative_to(ROOT)}/")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if ps_proto/ is stale")
    args = parser.parse_args()
    return check() if args.check else regenerate()


if __name__ == "__main__":
    sys.exit(main())
