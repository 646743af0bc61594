"""The floor of a Python HTTP server: httptools parses, uvloop runs, every request gets its
body echoed back (keep-alive, Content-Length), nothing else. bench/frontend_cpu.py compares
hybridgnn's CPU per request against it.

With --protocol, hybridgnn's own HTTP layer (serving/http: Connection, HttpServer, with
its limits, turns and timers) answers every request with one fixed inference answer
instead: what the protocol costs without any endpoint work. With --work-us N the echo
server first busy-waits N µs per request: what N µs of work costs in place on this
machine (a server that answers later lets the client's core sleep, and waking it costs
more than the work on a VM), the yardstick for reading the others' ratios.

    .venv/bin/python bench/echo_server.py --port 8099 [--protocol | --work-us 20]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIXED_ANSWER = (b'{"model_name":"hybridgnn","model_version":"1","outputs":[{"name":"logits","datatype":"FP32",'
                b'"shape":[1,4],"data":[0.1,0.2,0.3,0.4]}]}')


class Echo(asyncio.Protocol):
    work_s = 0.0  # busy-waited per request (--work-us)

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
        if self.work_s:
            until = time.perf_counter() + self.work_s
            while time.perf_counter() < until:
                pass
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                             b"Connection: keep-alive\r\n\r\n%s" % (len(body), body))


class FixedAnswer:
    """The API hybridgnn's HTTP server carries, answering everything with FIXED_ANSWER."""

    draining = False

    def __init__(self):
        from hybridgnn.serving.http.reply import Reply

        self.reply = Reply(200, FIXED_ANSWER, "application/json")
        self.error = Reply(500, b'{"error":"internal"}', "application/json")

    def route(self, method: str, path: str):
        return (lambda request: self.reply), {}

    def internal_error(self, where: str, exc=None):
        return self.error


async def main(port: int, protocol: bool) -> None:
    if protocol:
        from hybridgnn.serving.http.server import HttpServer

        server = HttpServer(FixedAnswer(), max_body_bytes=1 << 20)
        await server.start("127.0.0.1", port)
        await asyncio.Event().wait()
    server = await asyncio.get_running_loop().create_server(Echo, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--protocol", action="store_true", help="hybridgnn's HTTP layer with one fixed answer")
    ap.add_argument("--work-us", type=float, default=0.0, help="the echo server busy-waits this long per request")
    args = ap.parse_args()
    Echo.work_s = args.work_us * 1e-6
    uvloop.run(main(args.port, args.protocol))
