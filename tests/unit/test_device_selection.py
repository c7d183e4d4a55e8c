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
from ps_worker.cluster import worker_command
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


def install_fake_cupy(monkeypatch, device_count: int, context_error: str | None):
    cupy, cupyx = fake_cupy(device_count, context_error)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    # Imported afresh against the stand-in, and forgotten afterwards.
    # (`from ps_worker import _cupy_backend` finds the package attribute first.)
    monkeypatch.delitem(sys.modules, "ps_worker._cupy_backend", raising=False)
    monkeypatch.delattr(ps_worker, "_cupy_backend", raising=False)


def forget_fake_cupy() -> None:
    sys.modules.pop("ps_worker._cupy_backend", None)
    if hasattr(ps_worker, "_cupy_backend"):
        delattr(ps_worker, "_cupy_backend")


@pytest.fixture
def unusable_gpu(monkeypatch):
    install_fake_cupy(monkeypatch, 1, "cudaErrorDevicesUnavailable: CUDA-capable device(s) "
                                      "is/are busy or unavailable")
    yield
    forget_fake_cupy()


@pytest.fixture
def four_gpus(monkeypatch):
    install_fake_cupy(monkeypatch, 4, None)
    yield
    forget_fake_cupy()


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



@pytest.mark.parametrize("device, local_rank, gpu", [
    ("auto", None, 0), ("auto", 0, 0), ("auto", 2, 2), ("auto", 5, 1),
    ("cuda", None, 0), ("cuda", 3, 3), ("cuda", 6, 2),
    ("cuda:1", None, 1), ("cuda:1", 3, 1)])
def test_workers_of_a_host_spread_over_its_gpus_by_local_rank(four_gpus, device, local_rank,
                                                              gpu) -> None:
    """`auto` and `cuda` compute on GPU local_rank mod the GPUs visible (GPU 0 without a
    rank); `cuda:N` names its GPU whatever the rank. Without this, `ps-cluster --workers 4
    --device auto` on a 4-GPU host put all four workers on GPU 0."""
    messages: list[str] = []
    backend = select_backend(device, log=messages.append, local_rank=local_rank)
    assert backend.name == "cupy" and backend.device == f"cuda:{gpu}"
    if device == "auto":
        assert f"cuda:{gpu}" in messages[0], messages


def test_ps_worker_takes_its_local_rank_and_refuses_one_that_is_no_rank(capsys) -> None:
    parser = worker_cli.build_parser()
    config = worker_cli.config_from_args(parser, parser.parse_args(
        ["--coordinator", "127.0.0.1:1", "--local-rank", "3"]), environ={})
    assert config.local_rank == 3
    for bad in ["-1", "one", "1.5", ""]:
        with pytest.raises(SystemExit) as refused:
            parser.parse_args(["--coordinator", "127.0.0.1:1", "--local-rank", bad])
        assert refused.value.code == 2
        assert "--local-rank" in capsys.readouterr().err


def test_ps_cluster_gives_each_worker_its_index_as_local_rank() -> None:
    """ps-cluster's worker commands are ps-worker command lines whose local rank is the
    worker's index, with the device it was given."""
    parser = worker_cli.build_parser()
    for index in range(3):
        argv = worker_command("127.0.0.1:5", index, "auto", ["--no-shm"])
        assert argv[1:3] == ["-m", "ps_worker.cli"]
        args = parser.parse_args(argv[3:])
        assert (args.local_rank, args.device, args.worker_id, args.no_shm) == (
            index, "auto", f"worker-{index}", True)
