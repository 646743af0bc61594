"""The request a connection parses (serving/http/message.py): its head's rules and its body."""

import pytest

from hybridgnn.serving.http.message import MAX_HEADER_FIELDS, Message, Reject


def _head(*fields: tuple[bytes, bytes]) -> Message:
    msg = Message(0.0)
    for name, value in fields:
        msg.add_field(name, value)
    return msg


def test_fields_join_and_are_counted():
    msg = _head((b"Host", b"t"), (b"X-A", b" 1 "), (b"x-a", b"2"))
    assert msg.headers["x-a"] == "1, 2" and msg.hosts == 1
    many = Message(0.0)
    for i in range(MAX_HEADER_FIELDS):
        many.add_field(b"X-%d" % i, b"v")
    with pytest.raises(Reject, match="more than 100 header fields") as info:
        many.add_field(b"X-last", b"v")
    assert info.value.status == 431


@pytest.mark.parametrize("fields, version, status", [
    (((b"Host", b"t"),), "2.0", 505),
    ((), "1.1", 400),  # no Host
    (((b"Host", b"t"), (b"Content-Length", b"+5")), "1.1", 400),
    (((b"Host", b"t"), (b"Content-Length", b"101")), "1.1", 413),
    (((b"Host", b"t"), (b"Transfer-Encoding", b"gzip, chunked")), "1.1", 400),
    (((b"Host", b"t"), (b"Expect", b"magic")), "1.1", 417),
    (((b"Host", b"t"), (b"X", b"y" * 300)), "1.1", 431),
])
def test_heads_this_server_does_not_take_are_refused(fields, version, status):
    with pytest.raises(Reject) as info:
        _head(*fields).check_head(version, 256, 100)
    assert info.value.status == status


def test_a_continue_is_owed_to_an_http11_client_with_a_body_only():
    expect = (b"Expect", b"100-continue")
    assert _head((b"Host", b"t"), (b"Content-Length", b"5"), expect).check_head("1.1", 256, 100)
    assert not _head((b"Host", b"t"), (b"Content-Length", b"0"), expect).check_head("1.1", 256, 100)
    assert not _head((b"Content-Length", b"5"), expect).check_head("1.0", 256, 100)
    assert not _head((b"Host", b"t"), (b"Transfer-Encoding", b"Chunked")).check_head("1.1", 256, 100)


def test_a_body_in_pieces_is_one_buffer_within_its_bound():
    msg = Message(0.0)
    assert msg.body_bytes() == b""
    msg.add_body(b"ab", 5)
    assert msg.body_bytes() == b"ab"
    msg.add_body(b"cd", 5)
    assert len(msg.body) == 1 and msg.body_bytes() == b"abcd"
    with pytest.raises(Reject, match="limit 5 bytes"):
        msg.add_body(b"ef", 5)
