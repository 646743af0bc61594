"""The floor of a Python HTTP server: httptools parses, uvloop runs, every request gets its
body echoed back (keep-alive, Content-Length), nothing else. bench/frontend_cpu.py compares
hybridgnn's CPU per request against it.

    .venv/bin/python bench/echo_server.py --port 8099
"""

from __future__ import annotations

import argparse
import asyncio

import httptools
import uvloop


class Echo(asyncio.Protocol):
    def __init__(self):
        self.parser = httptools.HttpRequestParser(self)
        self.transport = None
        self.body = []

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_body(self, body):
        self.body.append(body)

    def on_message_complete(self):
        body = b"".join(self.body)
        self.body = []
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: keep-alive\r\n\r\n%s" % (len(body), body))


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    uvloop.run(main(ap.parse_args().port))
