"""Pulls that one unary call answers, made once and sent again while the shard map stands.

A worker pulls the same variables step after step. When they are all whole on one server
that is reached over gRPC and fit one message, everything but the call itself is the same
every time: the request's bytes, the server, the deadline, where each shard's bytes land and,
once an answer has been checked in full, the bytes that come before the values in every
answer (the header and the data field's length). PSClient keeps such a pull (`OneCallPull`)
and sends it again while its shard map is current; any other answer is checked in full, as
the general path checks it. For a small variable the general path's planning costs more
than the call's own client side (benchmarks/w4_latency.py).
"""

from __future__ import annotations

import grpc
import numpy as np

from ps_common.errors import InvalidArgument
from ps_common.shardmap import Shard, ShardMap
from ps_common.status import RemoteError
from ps_common.tensors import StreamAssembler, chunk_prefix, decode_chunk

# Distinct pulls (sets of names and wire dtype) kept at most per client; when full, all are
# dropped and made again as they come.
MAX_KEPT = 64


class OneCallPull:
    """One server's answer to a pull of whole variables: `request` (serialized) is sent as
    it is; `unpack` puts an answer's values into the outputs (in `names` order)."""

    __slots__ = ("shard_map", "server_id", "names", "request", "deadline", "nbytes",
                 "_parts", "_prefix")

    def __init__(self, shard_map: ShardMap, server_id: str, names: list[str],
                 shards: list[Shard], request: bytes, deadline: float):
        self.shard_map, self.server_id, self.names = shard_map, server_id, names
        self.request, self.deadline = request, deadline
        position = {name: i for i, name in enumerate(names)}
        # Per shard in the answer's order: its output and rows (None: the whole output).
        self._parts = []
        for shard in shards:
            rows = shard_map.variables[shard.variable].shape[0]
            whole = shard.row_start == 0 and shard.row_stop == rows
            self._parts.append((position[shard.variable],
                                None if whole else (shard.row_start, shard.row_stop)))
        self.nbytes = self.bytes_of(shard_map, shards)
        self._prefix: bytes | None = None  # known once an answer was checked in full

    @staticmethod
    def bytes_of(shard_map: ShardMap, shards: list[Shard]) -> int:
        return sum(shard.nbytes(shard_map.variables[shard.variable]) for shard in shards)

    def unpack(self, answer: bytes, outputs: list[np.ndarray]) -> None:
        """Copy the answer's values into `outputs`. An answer that does not start with the
        prefix of the last one checked is checked in full (raises as the general path)."""
        destinations = [outputs[i] if rows is None else outputs[i][rows[0]:rows[1]]
                        for i, rows in self._parts]
        prefix = self._prefix
        if (prefix is None or len(answer) != len(prefix) + self.nbytes
                or not answer.startswith(prefix)):
            self._check(answer, destinations)
            return
        view, position = memoryview(answer), len(prefix)
        for destination in destinations:
            # A memoryview copy: for small values, fewer calls than numpy's (a stored dtype
            # is one the buffer protocol knows; outputs are C-contiguous, no dimension 0).
            target = memoryview(destination).cast("B")
            target[:] = view[position:position + target.nbytes]
            position += target.nbytes

    def _check(self, answer: bytes, destinations: list[np.ndarray]) -> None:
        try:
            chunk = decode_chunk(answer)
        except InvalidArgument as error:  # as gRPC reports a reply it cannot deserialize
            raise RemoteError(grpc.StatusCode.INTERNAL, f"malformed pull answer: {error}",
                              target=self.server_id) from None
        assembler = StreamAssembler(destinations, what=f"pull from {self.server_id}")
        assembler.write(chunk.data)
        assembler.finish()
        # The values are the answer's last bytes, after this prefix: later answers that
        # start with it are laid out the same.
        expected = chunk_prefix(None if chunk.header is None else bytes(chunk.header),
                                self.nbytes)
        if len(answer) == len(expected) + self.nbytes and answer.startswith(expected):
            self._prefix = expected
