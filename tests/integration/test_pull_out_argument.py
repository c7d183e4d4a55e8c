"""`pull(..., out=)` takes a mapping of names to arrays: an array passed as `out` itself (as
`pull_rows(..., out=array)` takes it) is refused before anything is sent, never silently
left as it was while the pull lands in a fresh array (`"w" in array` is False for a float
array). The same for pull_async and push_pull."""

from __future__ import annotations

import numpy as np
import pytest

from ps_worker import PSClient, RemoteError

SHARED_MEMORY = False
SHAPE = (64, 32)  # 8 KiB: streamed in 64-byte chunks, one message with the default size


@pytest.fixture(params=[64, None], ids=["streamed", "unary"])
def ps(make_cluster, request):
    cluster = make_cluster(servers=1, chunk_bytes=64)
    kwargs = {} if request.param is None else {"chunk_bytes": request.param}
    with PSClient(cluster.coordinator_address, **kwargs) as client:
        client.declare("w", shape=SHAPE, init={"name": "constant", "value": 3.0})
        yield client


def written_or_refused(call, buffer: np.ndarray) -> None:
    """`call(buffer)` either fills `buffer` with the pulled values (3.0) or raises."""
    try:
        returned = call(buffer)
    except (RemoteError, ValueError, TypeError):
        assert (buffer == 0).all()  # refused before anything was written
        return
    assert (buffer == 3.0).all(), (
        f"out=<array> was accepted but not written (returned {type(returned).__name__}, "
        f"buffer still holds {np.unique(buffer).tolist()})")


def test_pull_with_an_array_as_out_fills_it_or_refuses_it(ps):
    written_or_refused(lambda buffer: ps.pull("w", out=buffer), np.zeros(SHAPE, np.float32))


def test_pull_async_with_an_array_as_out_fills_it_or_refuses_it(ps):
    written_or_refused(lambda buffer: ps.pull_async("w", out=buffer).result(timeout=30),
                       np.zeros(SHAPE, np.float32))


def test_push_pull_with_an_array_as_out_fills_it_or_refuses_it(ps):
    written_or_refused(
        lambda buffer: ps.push_pull({"w": np.zeros(SHAPE, np.float32)}, "w", out=buffer),
        np.zeros(SHAPE, np.float32))
