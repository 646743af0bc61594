"""The messages a worker process sends the server (process.py's write_message and
MessageReader) over a socketpair: whatever pieces the bytes arrive in, a non-blocking
read returns nothing until the message is whole and then exactly it; large arrays cross
out of the pickle and arrive writable; an end of stream or a stall mid-message fails."""

import socket
import struct
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridgnn.pipelines.process import (
    MESSAGE_HEAD,
    PENDING,
    MessageReader,
    write_message,
)


def encoded(message) -> bytes:
    """The bytes write_message puts on the wire for `message`."""
    a, b = socket.socketpair()
    with a, b:
        writer = threading.Thread(target=lambda: (write_message(a, message), a.shutdown(socket.SHUT_WR)))
        writer.start()  # a message past the socket's buffer waits for this end to read
        chunks = []
        while chunk := b.recv(1 << 20):
            chunks.append(chunk)
        writer.join()
    return b"".join(chunks)


def answer(rows: int, width: int):
    rng = np.random.default_rng(rows)
    return ("ok", (rng.standard_normal((rows, width)).astype(np.float32), np.arange(rows, dtype=np.int64), 0.5, 17))


def check_same(got, sent):
    assert got[0] == sent[0]
    for g, s in zip(got[1], sent[1], strict=True):
        if isinstance(s, np.ndarray):
            assert g.dtype == s.dtype and g.shape == s.shape and g.flags.writeable
            np.testing.assert_array_equal(g, s)
        else:
            assert g == s


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.sampled_from([0, 1, 3, 2000]), cuts=st.lists(st.floats(0, 1), max_size=6))
def test_a_message_in_any_pieces_is_read_whole_once_all_of_it_arrived(rows, cuts):
    sent = answer(rows, 16)
    wire = encoded(sent) + encoded(("error", "next"))  # a second message right behind the first
    first = len(encoded(sent))
    points = sorted({0, first, len(wire), *(int(c * len(wire)) for c in cuts)})
    a, b = socket.socketpair()
    with a, b:
        reader = MessageReader(b)
        got = []
        for lo, hi in zip(points, points[1:], strict=False):
            a.sendall(wire[lo:hi])
            while (message := reader.read(wait=False)) is not PENDING:
                got.append((hi, message))
        assert [g[0] >= first for g in got] == [True, True] and got[0][0] <= got[1][0]
        check_same(got[0][1], sent)
        assert got[1][1] == ("error", "next")
        assert reader.read(wait=False) is PENDING


def test_large_arrays_cross_out_of_the_pickle_and_small_answers_in_one_piece():
    big, small = encoded(answer(4000, 64)), encoded(answer(1, 64))
    size, count = MESSAGE_HEAD.unpack_from(big)
    assert count == 1 and size < 40_000  # the 1 MB array is a raw buffer; the 32 KB one is in the pickle
    assert struct.unpack_from("<Q", big, MESSAGE_HEAD.size)[0] == 4000 * 64 * 4
    assert MESSAGE_HEAD.unpack_from(small)[1] == 0


def test_an_end_of_stream_mid_message_is_an_eof_and_a_stall_times_out():
    wire = encoded(answer(2000, 16))
    a, b = socket.socketpair()
    with a, b:
        a.sendall(wire[: len(wire) // 2])
        reader = MessageReader(b)
        assert reader.read(wait=False) is PENDING
        a.shutdown(socket.SHUT_WR)  # the child is gone mid-answer
        with pytest.raises(EOFError):
            reader.read(wait=False)
    a, b = socket.socketpair()
    with a, b:
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 100_000))
        a.sendall(wire[:100])
        with pytest.raises(TimeoutError):
            MessageReader(b).read(wait=True)


def test_a_message_of_too_many_buffers_is_refused():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(MESSAGE_HEAD.pack(10, 1 << 20))
        with pytest.raises(ValueError, match="buffers"):
            MessageReader(b).read(wait=False)


def test_after_a_message_that_cannot_be_read_the_reader_reads_the_next_one():
    """A message whose pickle does not load leaves the reader at the next message, not stuck
    on the failed one (it read None for ever after)."""
    bad = bytearray(encoded(("ok", 1)))
    bad[MESSAGE_HEAD.size] ^= 0xFF  # the pickle's first byte: not a pickle
    a, b = socket.socketpair()
    with a, b:
        a.sendall(bytes(bad) + encoded(("error", "next")))
        reader = MessageReader(b)
        with pytest.raises(Exception):  # noqa: B017 - whatever unpickling raises
            reader.read(wait=False)
        assert reader.read(wait=False) == ("error", "next")
