"""ps-server --receive-window: the HTTP/2 receive window per call (ps_common.rpc).

Whatever the window (the smallest HTTP/2 allows, the default, or gRPC's own sizing), pushes
and pulls larger than it, streamed and in one message, carry exactly the same values; bad
values of the flag exit naming it.
"""

from __future__ import annotations

import numpy as np
import pytest

from ps_common import rpc
from ps_common.rpc import DEFAULT_RECEIVE_WINDOW_BYTES, receive_window_options
from ps_server.app import ParameterServer, ServerConfig
from ps_server.cli import build_parser, config_from_args
from ps_worker import PSClient

SGD1 = {"name": "sgd", "lr": 1.0}


@pytest.mark.parametrize("window", [64 << 10, DEFAULT_RECEIVE_WINDOW_BYTES, 0],
                         ids=["64KiB", "default", "grpc-sized"])
def test_pushes_and_pulls_larger_than_the_window_are_exact(make_cluster, window):
    cluster = make_cluster(servers=1, shared_memory=False, receive_window_bytes=window)
    rng = np.random.default_rng(7)
    with PSClient(cluster.coordinator_address, shared_memory=False) as ps:
        # 3 MiB: streamed in 2 MiB chunks; 1.5 MiB: one message each way. Both past 64 KiB
        # and past the default window.
        for name, shape in (("streamed", (768, 1024)), ("unary", (384, 1024))):
            ps.declare(name, shape, optimizer=SGD1, init="zeros")
            grad = rng.standard_normal(shape).astype(np.float32)
            ps.push({name: grad})
            np.testing.assert_array_equal(ps.pull(name), -grad)
            ps.push_pull({name: grad}, name)
            np.testing.assert_array_equal(ps.pull(name), -2 * grad)


@pytest.mark.parametrize("window", [DEFAULT_RECEIVE_WINDOW_BYTES, 4 << 20, 0])
def test_the_window_reaches_the_servers_grpc_options(window, monkeypatch):
    made = []
    real = rpc.grpc.server

    def recording(*args, **kwargs):
        made.append(dict(kwargs["options"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(rpc.grpc, "server", recording)
    server = ParameterServer(ServerConfig(receive_window_bytes=window, shared_memory=False))
    server.stop(0)
    (options,) = made
    if window:
        assert options["grpc.http2.bdp_probe"] == 0
        assert options["grpc.http2.lookahead_bytes"] == window
    else:  # gRPC's own sizing: neither option set
        assert "grpc.http2.bdp_probe" not in options
        assert "grpc.http2.lookahead_bytes" not in options
    assert options["grpc.keepalive_time_ms"] == rpc.KEEPALIVE_TIME_MS  # the others kept


def test_the_flag_sets_the_window_and_its_default_is_one_mebibyte():
    parser = build_parser()
    args = ["--coordinator", "127.0.0.1:1"]
    assert config_from_args(parser, parser.parse_args(args), environ={}).receive_window_bytes \
        == DEFAULT_RECEIVE_WINDOW_BYTES == ServerConfig().receive_window_bytes == 1 << 20
    for given, expected in (("4MiB", 4 << 20), ("0", 0), ("65536", 65536)):
        config = config_from_args(parser, parser.parse_args([*args, "--receive-window", given]),
                                  environ={})
        assert config.receive_window_bytes == expected
    # A fixed window turns gRPC's own sizing off; 0 leaves gRPC's options alone.
    assert dict(receive_window_options(4 << 20)) == {
        "grpc.http2.bdp_probe": 0, "grpc.http2.lookahead_bytes": 4 << 20}
    assert receive_window_options(0) == []


@pytest.mark.parametrize("value", ["1KiB", "-1", "2GiB"])
def test_a_bad_receive_window_exits_naming_the_flag(value, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exited:
        config_from_args(parser, parser.parse_args(
            ["--coordinator", "127.0.0.1:1", "--receive-window", value]), environ={})
    assert exited.value.code == 2
    assert "--receive-window" in capsys.readouterr().err
