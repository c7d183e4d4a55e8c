"""Length-prefixed frames over a stream socket: each frame is its length (4 bytes,
little-endian), then that many bytes: the push socket's format (ps_server.push_socket).
"""

from __future__ import annotations

import socket
import struct

_LENGTH = struct.Struct("<I")


def read_frame(sock: socket.socket, limit: int) -> bytes | None:
    """One length-prefixed frame, or None when the peer closed the socket between frames.
    Raises ConnectionError when it closed mid-frame or sent more than `limit` bytes."""
    head = _read_exactly(sock, _LENGTH.size, at_frame_start=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > limit:
        raise ConnectionError(f"a frame of {length} bytes (at most {limit})")
    return _read_exactly(sock, length, at_frame_start=False) if length else b""


def write_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def _read_exactly(sock: socket.socket, n: int, at_frame_start: bool) -> bytes | None:
    first = sock.recv(n)  # most frames arrive whole: one call
    if len(first) == n:
        return first
    if not first:
        if at_frame_start:
            return None
        raise ConnectionError("the peer closed the socket mid-frame")
    buffer = bytearray(first)
    while len(buffer) < n:
        more = sock.recv(n - len(buffer))
        if not more:
            raise ConnectionError("the peer closed the socket mid-frame")
        buffer += more
    return bytes(buffer)
