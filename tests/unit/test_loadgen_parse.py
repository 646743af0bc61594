"""The load generator's response-head parser (pure bytes, no sockets)."""

from hybridgnn.bench.loadgen import parse_response_head


def test_a_whole_head_gives_status_lengths_and_keep_alive():
    buf = bytearray(b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 12\r\nRetry-After: 1\r\n\r\n{\"error\": 1}")
    status, head, length, keep = parse_response_head(buf)
    assert (status, length, keep) == (429, 12, True)
    assert bytes(buf[head:head + length]) == b"{\"error\": 1}"


def test_header_names_are_case_insensitive_and_close_ends_keep_alive():
    buf = bytearray(b"HTTP/1.1 200 OK\r\ncontent-length:3\r\nCONNECTION: close\r\n\r\nabc")
    assert parse_response_head(buf)[1:] == (len(buf) - 3, 3, False)


def test_no_length_means_an_empty_body_and_a_partial_head_waits():
    assert parse_response_head(bytearray(b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n"))[2] == 0
    assert parse_response_head(bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n")) is None
