"""The link between the engine and rank 0 of its partition ranks (`serve --partitions N`).

Frames are serving/ipc/wire.py's (`<u32 length><u8 kind><u32 id>`, a JSON head, raw
little-endian arrays; never pickle). Rank 0 hands a call's payload to every rank as it
came, so all ranks decode the same bytes and run the same collectives. The link is
blocking and carries one call at a time: the ranks compute one request (batch) together.

An address is `unix:<path>` (ranks started by this server: a socket in a private
directory) or `host:port` (ranks started elsewhere, e.g. by torchrun).
"""

from __future__ import annotations

import os
import socket
import stat
import time

import numpy as np

from hybridgnn.serving.ipc.wire import (
    FRAME,
    MAX_FRAME,
    WireError,
    split_head,
    with_head,
)

# engine -> rank 0 (and rank 0 -> every rank)
NEW_NODES = 2  # head {mode, gamma, policy, seed}; arrays: features [q, f] float32, edge_index [2, e] int64
EXISTING = 3  # arrays: node ids (full neighbourhoods, from features)
LOOKUP = 4  # head {with_embeddings}; arrays: node ids (precomputed rows, from their owners)
PING = 5  # no payload: every rank answers (a dead rank fails the step)
STOP = 6  # every rank exits
UPDATE = 7  # head {check_only}; arrays: a graph-update batch (UpdateBatch.arrays)[, the new nodes' names]; answer: its report
RESET = 8  # every rank drops the updates it applied (its part as stored again)
# rank 0 -> engine
HELLO = 100  # head: the group's description (ranks, nodes, memory per rank, what it serves)
RESULT = 101  # head {recomputed, bytes_moved, compute_s[, removed]}; arrays: logits, embeddings
ERROR = 102  # head {status, message}: the request is bad for every rank (the same on all)
CALLS = {"new_nodes": NEW_NODES, "existing": EXISTING, "lookup": LOOKUP, "ping": PING, "update": UPDATE, "reset": RESET}


def encode(kind: int, rid: int, head: dict, arrays: tuple[np.ndarray, ...] = ()) -> bytes:
    """A frame: head plus arrays, each described in the head by dtype and shape."""
    arrays = tuple(np.ascontiguousarray(a) for a in arrays)
    specs = [[a.dtype.newbyteorder("<").str, list(a.shape)] for a in arrays]
    return with_head(kind, rid, {**head, "arrays": specs}, *(a.astype(a.dtype.newbyteorder("<"), copy=False)
                                                              .tobytes() for a in arrays))


def decode(payload: memoryview | bytes) -> tuple[dict, list[np.ndarray]]:
    """(head, arrays) of an encode() payload; WireError when it does not add up."""
    head, rest = split_head(memoryview(payload))
    if not isinstance(head, dict) or not isinstance(head.get("arrays"), list):
        raise WireError("head without its arrays")
    arrays, at = [], 0
    try:
        for dtype, shape in head.pop("arrays"):
            dt = np.dtype(dtype)
            count = int(np.prod(shape)) if shape else 1
            size = count * dt.itemsize
            if at + size > len(rest) or count < 0:
                raise WireError("arrays longer than the payload")
            arrays.append(np.frombuffer(rest[at:at + size], dtype=dt).reshape(shape)
                          .astype(dt.newbyteorder("="), copy=False))
            at += size
    except (TypeError, ValueError) as exc:
        raise WireError(f"array description: {exc}") from None
    return head, arrays


class Link:
    """One blocking, framed connection (either end). recv() raises ConnectionError when
    the other end is gone, TimeoutError when no frame started within the timeout, and
    WireError when a frame that started did not end within its bound."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout_s: float | None, rest_s: float | None = None,
             kinds: tuple[int, ...] | None = None) -> tuple[int, int, memoryview]:
        """The next frame, waiting up to timeout_s for it to start and then up to rest_s for
        the rest (None: for ever). Past rest_s the stream is out of step: a WireError, never
        the TimeoutError of an idle link, so the caller drops the link instead of reading on.
        A frame of a kind not in `kinds` (None: any) is a WireError before its payload is
        read: a peer that is no rank (its first bytes read as a length of up to 2 GB) is
        refused at once."""
        self.sock.settimeout(timeout_s)
        first = self.sock.recv(FRAME.size)
        if not first:
            raise ConnectionError("the other end closed the link")
        deadline = None if rest_s is None else time.monotonic() + rest_s
        length, kind, rid = FRAME.unpack(first + self._exactly(FRAME.size - len(first), deadline))
        if not 5 <= length <= MAX_FRAME:
            raise WireError(f"frame length {length}")
        if kinds is not None and kind not in kinds:
            raise WireError(f"a frame of kind {kind}, not one of {list(kinds)}")
        return kind, rid, memoryview(self._exactly(length - 5, deadline))

    def _exactly(self, n: int, deadline: float | None) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = None if deadline is None else deadline - time.monotonic()
            try:
                if left is not None and left <= 0:
                    raise TimeoutError
                self.sock.settimeout(left)
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except TimeoutError:  # a sender that stopped (or trickles) mid-frame
                raise WireError(f"a frame cut short: {got} of {n} bytes came in time") from None
            if not chunk:
                raise ConnectionError("the other end closed the link")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _family(address: str) -> tuple[int, object]:
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[5:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"rank 0's address must be host:port or unix:<path>, got {address!r}")
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, (host.strip("[]") or "0.0.0.0", int(port))


def listen(address: str) -> socket.socket:
    """A listening socket at `address` (rank 0's end)."""
    family, where = _family(address)
    if family == socket.AF_UNIX and os.path.exists(where) and stat.S_ISSOCK(os.stat(where).st_mode):
        os.unlink(where)  # left by a rank 0 that was killed (a restart binds the same path)
    sock = socket.socket(family, socket.SOCK_STREAM)
    if family != socket.AF_UNIX:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(where)
    sock.listen(1)
    return sock


def connect(address: str, timeout_s: float) -> Link:
    """A link to rank 0 at `address` (the engine's end); OSError when nothing answers."""
    family, where = _family(address)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(where)
    except OSError:
        sock.close()
        raise
    if family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Link(sock)
