"""--device when CuPy is there but the GPU it lists cannot be used, and --device values that
name no device, with a stand-in for CuPy (the real one runs in tests/gpu).

A GPU that CUDA lists can still refuse a new context: another process holds it in
EXCLUSIVE_PROCESS compute mode, or its memory is full (several workers sharing one GPU, as
the README suggests). CuPy raises CUDARuntimeError then, from cudaSetDevice or the first
stream, i.e. in CupyBackend.__init__: `auto` then uses NumPy, a named device is refused
naming --device.
"""

from __future__ import annotations

import sys
import types

import pytest

import ps_worker
from ps_worker import cli as worker_cli
from ps_worker.backend import BackendUnavailable, select_backend
from ps_worker.runtime import Worker


class CUDARuntimeError(RuntimeError):
    """As cupy_backends.cuda.api.runtime.CUDARuntimeError."""


def fake_cupy(device_count: int, context_error: str | None):
    """Modules `cupy` and `cupyx` with what ps_worker._cupy_backend touches at import and in
    CupyBackend.__init__: one listed GPU whose context cannot be made."""
    cupy = types.ModuleType("cupy")
    runtime = types.SimpleNamespace(CUDARuntimeError=CUDARuntimeError,
                                    getDeviceCount=lambda: device_count)

    class Device:
        def __init__(self, index):
            self.id = index

        def use(self):
            if context_error is not None:
                raise CUDARuntimeError(context_error)

        def __enter__(self):
            self.use()
            return self

        def __exit__(self, *exc):
            return False

    class Stream:
        def __init__(self, non_blocking=False):
            if context_error is not None:
                raise CUDARuntimeError(context_error)

    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=Device, Stream=Stream)
    cupy.get_array_module = lambda *arrays: None
    cupyx = types.ModuleType("cupyx")
    return cupy, cupyx


@pytest.fixture
def unusable_gpu(monkeypatch):
    cupy, cupyx = fake_cupy(1, "cudaErrorDevicesUnavailable: CUDA-capable device(s) is/are "
                               "busy or unavailable")
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    # Imported afresh against the stand-in, and forgotten afterwards.
    # (`from ps_worker import _cupy_backend` finds the package attribute first.)
    monkeypatch.delitem(sys.modules, "ps_worker._cupy_backend", raising=False)
    monkeypatch.delattr(ps_worker, "_cupy_backend", raising=False)
    yield
    sys.modules.pop("ps_worker._cupy_backend", None)
    if hasattr(ps_worker, "_cupy_backend"):
        delattr(ps_worker, "_cupy_backend")


def test_auto_with_a_listed_but_unusable_gpu_uses_numpy_or_says_why(unusable_gpu) -> None:
    """backend.select_backend: "`auto` picks CuPy on GPU 0 when CuPy imports and sees a GPU,
    NumPy otherwise, and reports its choice and the reason"; ps-worker --help: "auto (CuPy
    on a GPU if present, else NumPy)". A GPU it cannot use is no GPU to compute on: the
    worker should run on NumPy (or refuse with BackendUnavailable, which ps-worker prints
    naming --device), not die of a raw CUDA error."""
    messages: list[str] = []
    try:
        backend = select_backend("auto", log=messages.append)
    except BackendUnavailable:
        return
    assert backend.name == "numpy" and len(messages) == 1, messages


def test_naming_a_listed_but_unusable_gpu_raises_backend_unavailable(unusable_gpu) -> None:
    """"Raises ``BackendUnavailable`` when a CUDA device is named but CuPy or that GPU is
    missing": ps-worker turns that (and only that) into `ps-worker: --device cuda:0: ...`."""
    with pytest.raises(BackendUnavailable) as raised:
        select_backend("cuda:0")
    assert "cuda:0" in str(raised.value) and "busy or unavailable" in str(raised.value)


def test_ps_worker_with_an_unusable_gpu_exits_1_with_a_line_naming_device(unusable_gpu,
                                                                          capsys) -> None:
    """The process: exit status 1 and one line naming --device, as for a missing GPU (the
    device is chosen before the coordinator is called, so none is needed here)."""
    parser = worker_cli.build_parser()
    args = parser.parse_args(["--coordinator", "127.0.0.1:1", "--device", "cuda:0",
                              "--coordinator-timeout", "1"])
    config = worker_cli.config_from_args(parser, args, environ={})
    status = worker_cli._run(Worker(config), args, config)
    assert status == 1
    assert "--device cuda:0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["cuda0", "cuda:", "cuda:-1", "cuda:0,1"])
def test_a_device_value_that_names_no_device_is_refused_naming_the_flag(value, capsys) -> None:
    """ps-worker --device takes "auto | cpu | cuda:N". These values pass its flag check (they
    start with "cuda"), then select_backend's ValueError is printed as "the job cannot run
    here: device ..." after the worker started: it never names --device, and blames the job.
    """
    parser = worker_cli.build_parser()
    args = parser.parse_args(["--coordinator", "127.0.0.1:1", "--device", value,
                              "--coordinator-timeout", "1"])
    try:
        config = worker_cli.config_from_args(parser, args, environ={})
    except SystemExit as refused:
        assert refused.code == 2
        assert "--device" in capsys.readouterr().err
        return
    status = worker_cli._run(Worker(config), args, config)
    err = capsys.readouterr().err
    assert status == 1
    assert "--device" in err and "the job cannot run here" not in err, err

