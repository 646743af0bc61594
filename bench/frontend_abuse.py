"""Abuse the HTTP front end of a real `hybridgnn serve` (started here on 127.0.0.1) and check
it holds: memory, time limits, the connection cap and shutdown under overload.

1. flood: one connection sends --flood-mib of pipelined small valid requests and never reads
   an answer. The server's RSS (VmRSS) is sampled before and during; target: growth <=
   --rss-limit-mib. The sender is non-blocking with a deadline: once the server pauses
   reading, the socket buffers fill and sending stops making progress; after
   --flood-stall-s without progress the flood ends ("server paused reading after X MiB",
   the expected outcome). Then a good inference on a new connection must answer 200.
2. slowloris: --slowloris-conns connections each send a request head one byte every
   --byte-interval-s (uniform within it), on one event loop; the server runs with
   --request-timeout-s T. Target: every connection closed by the server (408 and FIN)
   within T + 1 s of its first byte. The client keeps trickling bytes after the FIN (as an
   attacker would); when the server releases the connections for good is read from its open
   descriptors (/proc/<pid>/fd), reported beside the target.
3. connflood: --connflood-conns connection attempts opened and held (up to this process's
   descriptor limit) against a server with --max-connections; meanwhile a good client on a
   keep-alive connection opened before the flood, and another opening a fresh connection
   per request, each ask every --good-interval-ms. Target: the keep-alive client gets only
   200s; the fresh one gets 200s or 503 "too many connections" while the cap is full (counted
   and reported), nothing else.
4. sigterm: capacity measured closed-loop (1-seed inferences on keep-alive connections),
   then --overload x that rate offered open-loop (Poisson) on keep-alive connections, at most
   --sigterm-max-conns of them, each request written as soon as its connection is up; after
   --sigterm-after-s the server gets SIGTERM and requests keep coming until it exits. Every
   request is classified: answered (by status), refused at connect (never accepted: a
   balancer retries it), or sent and then closed/reset without an answer (target: 0).

Each part starts its own server (the demo graph and model, or --dataset/--model, or --small:
a 3,000-node graph built in a temporary directory as bench/fuzz.py does). Prints a short
table, then one JSON summary (stdout; --json-out writes it to a file too); exits 1 if a
target is missed. Progress goes to stderr.

    .venv/bin/python bench/frontend_abuse.py [--small] [--only flood,slowloris,connflood,sigterm]
    .venv/bin/python bench/frontend_abuse.py --small --flood-mib 64 --slowloris-conns 200 \\
        --request-timeout-s 2 --connflood-conns 2000 --max-connections 500      # a smoke run
    .venv/bin/python bench/frontend_abuse.py -- --workers 1                     # flags after -- go to serve
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import json
import os
import random
import resource
import select
import signal
import socket
import sys
import tempfile
import termios
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httptools  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import machine  # noqa: E402
from bench.fuzz import Server, small_dataset  # noqa: E402
from hybridgnn.bench.report import finite  # noqa: E402
from hybridgnn.capabilities import run_async  # noqa: E402
from tests.support.fuzz import KeepAliveClient, NoAnswer, Target, good_case  # noqa: E402

PARTS = ("flood", "slowloris", "connflood", "sigterm")
MiB = 1 << 20
HOST = "127.0.0.1"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- the server process, seen from outside ---------------------------------------------------------
def server_pids(pid: int) -> list[int]:
    """The server's process and every process it started (front ends, workers), alive now."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def rss_mib(pid: int) -> float | None:
    """Resident memory of the server: its process and those it started (with --frontends N,
    the front end a flood reaches is one of them)."""
    total, seen = 0.0, False
    for p in server_pids(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
                        seen = True
        except OSError:
            pass
    return total if seen else None


def fd_count(pid: int) -> int | None:
    """Open descriptors of the server's processes (connections live in its front ends)."""
    counts = []
    for p in server_pids(pid):
        try:
            counts.append(len(os.listdir(f"/proc/{p}/fd")))
        except OSError:
            pass
    return sum(counts) if counts else None


def start_server(dataset: Path, model: Path, extra: list[str], label: str) -> Server:
    t0 = time.monotonic()
    srv = Server(dataset, model, "frontend-abuse-token", extra)
    try:
        srv.wait_ready(timeout_s=300)
    except BaseException:
        srv.stop()
        raise
    log(f"[{label}] server pid {srv.proc.pid} on port {srv.port} ready in {time.monotonic() - t0:.1f} s "
        f"(flags: {' '.join(extra) or 'defaults'})")
    return srv


def finish(srv: Server, res: dict) -> dict:
    """Stop the server (SIGTERM, as an orchestrator would); a non-zero exit is reported with its log."""
    code = srv.stop()
    res["server_exit_code"] = code
    if code != 0:
        res["server_log_tail"] = srv.output()[-2000:]
        res["pass"] = False
    return res


def good_request_sync(target: Target, timeout_s: float = 5.0) -> dict:
    """A good inference on a new connection."""
    case = good_case(target)
    client = KeepAliveClient(target.host, target.port, timeout_s)
    t0 = time.monotonic()
    try:
        r = client.request(case.method, case.path, case.body, case.headers)
        return {"status": r.status, "ms": round((time.monotonic() - t0) * 1000, 2)}
    except (NoAnswer, OSError) as exc:
        return {"status": None, "error": f"{type(exc).__name__}: {exc}"[:200],
                "ms": round((time.monotonic() - t0) * 1000, 2)}
    finally:
        client.close()


def infer_bytes(port: int, model: str, node: int, mode: bytes | None = None) -> bytes:
    """A 1-seed JSON inference (mode: its parameters.mode, else the server's default)."""
    params = b',"parameters":{"mode":"%s"}' % mode if mode else b""
    body = b'{"inputs":[{"name":"node_ids","shape":[1],"datatype":"INT64","data":[%d]}]%s}' % (node, params)
    return (b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (model.encode(), HOST.encode(), port, len(body))) + body


def pct(values, qs=(50, 99)) -> list[float | None]:
    if len(values) == 0:
        return [None] * len(qs)
    return [round(float(v), 2) for v in np.percentile(np.asarray(values, dtype=float), qs)]


def err_name(exc: BaseException | None) -> str:
    if exc is None:
        return "eof"
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno is not None:
        return errno.errorcode.get(exc.errno, str(exc.errno))
    return type(exc).__name__


# --- a small asyncio HTTP/1.1 client --------------------------------------------------------------
class HttpConn(asyncio.Protocol):
    """One client connection, one request at a time; answers parsed by llhttp. `on_answer(conn,
    token, status, keep_alive)` and `on_lost(conn, token, why)` are called back (token: what
    send() was given; on_lost's token is None when nothing was in flight)."""

    def __init__(self, on_answer, on_lost, first=None):
        self.on_answer, self.on_lost = on_answer, on_lost
        self.first = first  # (bytes, token): written as soon as the connection is up
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.token = None
        self.busy = False
        self.closed = False
        self.eof = False
        self.requests = 0
        self.unsolicited: int | None = None  # an answer before any request (503 at the connection cap)
        self.made_t: float | None = None
        self.got_bytes = 0

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.made_t = time.monotonic()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.first is not None:
            data, token = self.first
            self.first = None
            self.send(data, token)

    def send(self, data: bytes, token) -> None:
        if self.closed or self.transport.is_closing():
            raise ConnectionError("closed before the request was sent")
        self.token, self.busy = token, True
        self.requests += 1
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        self.got_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.abort()

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:
            return
        keep = self.parser.should_keep_alive()
        if not self.busy:
            self.unsolicited = status
            return
        token, self.token, self.busy = self.token, None, False
        if not keep:
            self.closed = True
            self.transport.close()
        self.on_answer(self, token, status, keep)

    def eof_received(self) -> bool:
        self.eof = True
        return False

    def connection_lost(self, exc) -> None:
        self.closed = True
        token, busy = self.token, self.busy
        self.token, self.busy = None, False
        why = err_name(exc) if exc is not None else "eof"
        self.on_lost(self, token if busy else None, why)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


async def connect(factory, timeout_s: float = 10.0):
    loop = asyncio.get_running_loop()
    _, proto = await asyncio.wait_for(loop.create_connection(factory, HOST, PORT[0]), timeout_s)
    return proto


PORT = [0]  # the port of the server the async parts talk to


class GoodClient:
    """Asks a 1-seed inference every interval_s, either on one keep-alive connection (opened
    before the abuse starts; reopened only if the server closes it) or on a fresh connection
    per request. Records (time, phase, status or error, latency ms)."""

    def __init__(self, model: str, num_nodes: int, interval_s: float, keepalive: bool, timeout_s: float = 5.0):
        self.model, self.num_nodes = model, num_nodes
        self.interval_s, self.keepalive, self.timeout_s = interval_s, keepalive, timeout_s
        self.conn: HttpConn | None = None
        self.fut: asyncio.Future | None = None
        self.records: list[tuple[float, str, object, float]] = []
        self.reconnects = 0
        self.phase = "before"
        self.stopped = False
        self.rng = random.Random(1 if keepalive else 2)

    def _answer(self, conn, token, status, keep):
        if self.fut is not None and not self.fut.done():
            self.fut.set_result(status)

    def _lost(self, conn, token, why):
        if token is not None and self.fut is not None and not self.fut.done():
            # A 503 at the connection cap can arrive just before the request is written and
            # the close just after: the server answered; the request was never read.
            self.fut.set_result(conn.unsolicited or f"lost:{why}")

    async def open(self) -> None:
        self.conn = await connect(lambda: HttpConn(self._answer, self._lost), self.timeout_s)

    async def one(self) -> None:
        t0 = time.monotonic()
        phase = self.phase
        result: object
        try:
            if not self.keepalive or self.conn is None or self.conn.closed:
                if self.keepalive and self.conn is not None:
                    self.reconnects += 1
                self.conn = None
                await self.open()
        except (OSError, asyncio.TimeoutError) as exc:
            result = f"connect:{err_name(exc)}"
        else:
            self.fut = asyncio.get_running_loop().create_future()
            try:
                self.conn.send(infer_bytes(PORT[0], self.model, self.rng.randrange(self.num_nodes)), 1)
                result = await asyncio.wait_for(self.fut, max(0.01, self.timeout_s - (time.monotonic() - t0)))
            except asyncio.TimeoutError:
                result = "timeout"
                self.conn.close()  # its late answer must not be taken for the next request's
            except ConnectionError:  # the server answered (503 at the cap) or closed before we sent
                result = self.conn.unsolicited or "closed_before_send"
            if not self.keepalive:
                self.conn.close()
        self.records.append((t0, phase, result, (time.monotonic() - t0) * 1000))

    async def run(self) -> None:
        next_t = time.monotonic()
        while not self.stopped:
            await self.one()
            next_t += self.interval_s
            delay = next_t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                next_t = time.monotonic()
        if self.conn is not None:
            self.conn.close()

    def summary(self, phase: str | None = None) -> dict:
        recs = [r for r in self.records if phase is None or r[1] == phase]
        statuses: dict[str, int] = {}
        for _, _, res, _ in recs:
            statuses[str(res)] = statuses.get(str(res), 0) + 1
        ok = [ms for _, _, res, ms in recs if res == 200]
        p50, p99 = pct(ok)
        return {"requests": len(recs), "ok": len(ok), "success_rate": round(len(ok) / len(recs), 4) if recs else None,
                "statuses": statuses, "p50_ms": p50, "p99_ms": p99,
                "max_ms": round(max(ok), 2) if ok else None}


def start_good_clients(target: Target, interval_s: float) -> tuple[GoodClient, GoodClient]:
    return (GoodClient(target.model, target.num_nodes, interval_s, keepalive=True),
            GoodClient(target.model, target.num_nodes, interval_s, keepalive=False))


# --- 1. pipelining flood ---------------------------------------------------------------------------
def part_flood(args, dataset, model) -> dict:
    srv = start_server(dataset, model, list(args.serve_args), "flood")
    try:
        pid = srv.proc.pid
        target = Target.discover(HOST, srv.port)
        for _ in range(3):
            good_request_sync(target)  # warm: first-call allocations are not the flood's doing
        if args.flood_request == "live":
            req = b"GET /v2/health/live HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (HOST.encode(), srv.port)
        else:
            req = infer_bytes(srv.port, target.model, 0, b"precomputed" if args.flood_request == "lookup" else None)
        chunk = memoryview(req * max(1, (256 * 1024) // len(req)))
        total = int(args.flood_mib * MiB)
        rss0 = rss_mib(pid)
        rss_max, rss_trace = rss0, []
        sock = socket.create_connection((HOST, srv.port), timeout=5)
        sock.setblocking(False)
        sent, pos = 0, 0
        t0 = time.monotonic()
        last_progress = last_sample = t0
        outcome, error = "sent_all", None
        while sent < total:
            now = time.monotonic()
            if now - last_sample >= 0.02:
                last_sample = now
                r = rss_mib(pid)
                if r is not None:
                    rss_max = max(rss_max, r)
                    if not rss_trace or now - rss_trace[-1][0] - t0 >= 0.5:
                        rss_trace.append((now - t0, r))
                if srv.proc.poll() is not None:
                    outcome = "server_died"
                    break
            if now - last_progress > args.flood_stall_s:
                outcome = "paused"
                break
            _, w, _ = select.select([], [sock], [], 0.05)
            if not w:
                continue
            try:
                n = sock.send(chunk[pos:pos + min(len(chunk) - pos, total - sent)])
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                outcome, error = "connection_error", err_name(exc)
                break
            if n:
                sent += n
                pos = (pos + n) % len(chunk)
                last_progress = time.monotonic()
        elapsed = time.monotonic() - t0
        try:
            unread = int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"), "little")
        except OSError:
            unread = None
        # The flood connection stays open (server paused on it) while a good client asks.
        check = good_request_sync(target)
        rss_during_check = rss_mib(pid)
        rss_max = max(rss_max, rss_during_check or 0)
        sock.close()
        alive = srv.proc.poll() is None
        after_close = good_request_sync(target) if alive else {"status": None, "error": "server exited"}
        growth = round(rss_max - rss0, 1) if rss0 is not None else None
        ok = (growth is not None and growth <= args.rss_limit_mib and check.get("status") == 200 and alive
              and outcome in ("paused", "sent_all"))
        res = {
            "request": args.flood_request, "request_bytes": len(req), "target_mib": args.flood_mib,
            "sent_mib": round(sent / MiB, 2), "requests_sent": sent // len(req), "outcome": outcome,
            "error": error, "seconds": round(elapsed, 2),
            "stalled_after_s": round(last_progress - t0, 2) if outcome == "paused" else None,
            "answer_bytes_unread_at_client_mib": round(unread / MiB, 2) if unread is not None else None,
            "rss_before_mib": round(rss0, 1) if rss0 else None, "rss_max_mib": round(rss_max, 1) if rss_max else None,
            "rss_growth_mib": growth, "rss_limit_mib": args.rss_limit_mib,
            "rss_trace": {"t_s": [round(t, 1) for t, _ in rss_trace[-40:]],
                          "mib": [round(r, 1) for _, r in rss_trace[-40:]]},
            "good_request_during": check, "good_request_after_close": after_close, "server_alive": alive,
            "pass": bool(ok),
        }
        if outcome == "paused":
            res["note"] = f"server paused reading after {sent / MiB:.1f} MiB"
    except BaseException:
        srv.stop()
        raise
    return finish(srv, res)


# --- 2. slowloris ----------------------------------------------------------------------------------
class Slow(asyncio.Protocol):
    """A request head sent one byte at a time; bytes keep coming after the server's FIN."""

    HEAD = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 4096

    def __init__(self, rng: random.Random, interval: tuple[float, float]):
        self.rng, self.interval = rng, interval
        self.transport = None
        self.first_byte = None
        self.next_t = 0.0
        self.pos = 0
        self.data = b""
        self.eof_t = None
        self.lost_t = None
        self.lost_why = None
        self.last_write = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.first_byte = time.monotonic()
        self.write_one(self.first_byte)

    def write_one(self, now: float) -> None:
        self.transport.write(self.HEAD[self.pos % len(self.HEAD):self.pos % len(self.HEAD) + 1])
        self.pos += 1
        self.last_write = now
        self.next_t = now + self.rng.uniform(*self.interval)

    def data_received(self, data: bytes) -> None:
        if len(self.data) < 256:
            self.data += data[:256]

    def eof_received(self) -> bool:
        self.eof_t = time.monotonic()
        return True  # keep our side open: keep sending, as an attacker would

    def connection_lost(self, exc) -> None:
        self.lost_t = time.monotonic()
        self.lost_why = err_name(exc)
        if self.eof_t is None and exc is None:
            self.eof_t = self.lost_t

    @property
    def closed_t(self):  # the server stopped the connection (FIN, or reset)
        if self.eof_t is not None:
            return self.eof_t
        return self.lost_t


async def slowloris(args, target: Target, pid: int) -> dict:
    T = args.request_timeout_s
    rng = random.Random(0)
    interval = (args.byte_interval_s[0], args.byte_interval_s[1])
    conns: list[Slow] = []
    connect_errors: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    sem = asyncio.Semaphore(args.connect_concurrency)
    ka, fresh = start_good_clients(target, args.good_interval_ms / 1000)
    await ka.open()
    good_tasks = [loop.create_task(ka.run()), loop.create_task(fresh.run())]
    await asyncio.sleep(0.3)
    baseline_fds = fd_count(pid) or 0  # with the good clients' connections
    ka.phase = fresh.phase = "during"
    t_start = time.monotonic()

    async def open_one():
        async with sem:
            proto = Slow(rng, interval)
            try:
                await asyncio.wait_for(loop.create_connection(lambda: proto, HOST, target.port), 10)
                conns.append(proto)
            except (OSError, asyncio.TimeoutError) as exc:
                name = err_name(exc)
                connect_errors[name] = connect_errors.get(name, 0) + 1

    opener = asyncio.ensure_future(asyncio.gather(*(open_one() for _ in range(args.slowloris_conns))))
    samples = []  # (t, connected, open without FIN, server descriptors)
    last_sample = 0.0
    while True:
        now = time.monotonic()
        for c in conns:
            if c.lost_t is None and c.next_t <= now and not c.transport.is_closing():
                try:
                    c.write_one(now)
                except RuntimeError:  # the transport just died; connection_lost says how
                    c.lost_t = c.lost_t or now
        if now - last_sample >= 0.1:
            last_sample = now
            samples.append((now - t_start, len(conns), sum(1 for c in conns if c.closed_t is None), fd_count(pid)))
        if opener.done():
            last_first = max((c.first_byte for c in conns), default=now)
            all_closed = all(c.closed_t is not None for c in conns)
            fds = samples[-1][3]
            if all_closed and fds is not None and fds <= baseline_fds + 2 and now - last_first > 0.5:
                break  # every connection closed and the server holds none of them any more
            if now > last_first + 2 * T + args.slowloris_grace_s:
                break
        await asyncio.sleep(0.05)
    await opener
    ka.stopped = fresh.stopped = True
    await asyncio.gather(*good_tasks)
    for c in conns:
        if c.transport is not None and not c.transport.is_closing():
            c.transport.abort()
    closed_after = [c.closed_t - c.first_byte for c in conns if c.closed_t is not None]
    statuses: dict[str, int] = {}
    for c in conns:
        key = c.data[9:12].decode("latin-1") if c.data.startswith(b"HTTP/1.") else ("none" if not c.data else "other")
        statuses[key] = statuses.get(key, 0) + 1
    within = sum(1 for x in closed_after if x <= T + 1)
    p50, p99 = pct(closed_after)
    # Server side: when its descriptor count came back to the baseline (every slow connection
    # released), measured from the first byte of the last connection to open.
    first_bytes = [c.first_byte - t_start for c in conns]
    last_first = max(first_bytes, default=0.0)
    peak = max((sm[3] or 0 for sm in samples), default=0)
    released_at = None
    for t, _, _, fds in samples:
        if t > last_first and fds is not None and fds <= baseline_fds + 2 and peak > baseline_fds + 2:
            released_at = t
            break
    thinned = samples[::5] + ([samples[-1]] if samples and (len(samples) - 1) % 5 else [])
    ka_s, fr_s = ka.summary("during"), fresh.summary("during")
    ok = (len(conns) > 0 and within == len(conns) and ka_s["ok"] == ka_s["requests"]
          and fr_s["ok"] == fr_s["requests"])
    return {
        "request_timeout_s": T, "byte_interval_s": list(interval), "attempted": args.slowloris_conns,
        "connected": len(conns), "connect_errors": connect_errors,
        "connect_spread_s": round(last_first - min(first_bytes, default=0.0), 2),
        "closed_by_server_within_T_plus_1": within,
        "closed_after_first_byte_s": {"p50": p50, "p99": p99,
                                      "max": round(max(closed_after), 2) if closed_after else None,
                                      "what": "the server's FIN (after its answer), seen by the client"},
        "never_closed": len(conns) - len(closed_after),
        "answers": statuses,
        "server_fds_baseline": baseline_fds, "server_fds_peak": peak,
        "server_released_all_s_after_last_first_byte": round(released_at - last_first, 2) if released_at else None,
        "server_released_all_within_T_plus_1": released_at is not None and released_at - last_first <= T + 1,
        "release_note": "the client keeps sending a byte every interval after the server's FIN; the server "
                        "drops them while it lingers and holds the descriptor until it closes",
        "timeline": {"t_s": [round(sm[0], 1) for sm in thinned],
                     "connected": [sm[1] for sm in thinned],
                     "open_without_fin": [sm[2] for sm in thinned],
                     "server_fds": [sm[3] for sm in thinned]},
        "good_keepalive": ka_s, "good_fresh": fr_s,
        "pass": bool(ok),
    }


def part_slowloris(args, dataset, model) -> dict:
    extra = ["--request-timeout-s", f"{args.request_timeout_s:g}", *args.serve_args]
    srv = start_server(dataset, model, extra, "slowloris")
    try:
        target = Target.discover(HOST, srv.port)
        PORT[0] = srv.port
        res = run_async(slowloris(args, target, srv.proc.pid))
        res["server_alive"] = srv.proc.poll() is None
        res["good_request_after"] = good_request_sync(target) if res["server_alive"] else None
        res["pass"] = res["pass"] and res["server_alive"] and res["good_request_after"]["status"] == 200
    except BaseException:
        srv.stop()
        raise
    return finish(srv, res)


# --- 3. connection flood ---------------------------------------------------------------------------
class Held(asyncio.Protocol):
    def __init__(self, stats: dict):
        self.stats = stats
        self.transport = None
        self.status = None
        self.done = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.stats["open"] += 1
        self.stats["peak_open"] = max(self.stats["peak_open"], self.stats["open"])

    def data_received(self, data: bytes) -> None:
        if self.status is None and data.startswith(b"HTTP/1."):
            self.status = data[9:12].decode("latin-1")
            key = f"answered_{self.status}"
            self.stats[key] = self.stats.get(key, 0) + 1
            if b"too many connections" in data:
                self.stats["too_many_connections"] += 1

    def eof_received(self) -> bool:
        return False  # the server closed it: close ours (frees the descriptor)

    def connection_lost(self, exc) -> None:
        if not self.done:
            self.done = True
            self.stats["open"] -= 1
            if not self.stats["closing"]:
                self.stats["closed_by_server"] += 1
                if self.status is None:
                    key = f"closed_without_answer_{err_name(exc)}"
                    self.stats[key] = self.stats.get(key, 0) + 1


async def connflood(args, target: Target, pid: int) -> dict:
    loop = asyncio.get_running_loop()
    stats = {"open": 0, "peak_open": 0, "closed_by_server": 0, "too_many_connections": 0, "closing": False}
    errors: dict[str, int] = {}
    held: list[Held] = []
    ka, fresh = start_good_clients(target, args.good_interval_ms / 1000)
    await ka.open()
    good_tasks = [loop.create_task(ka.run()), loop.create_task(fresh.run())]
    await asyncio.sleep(args.connflood_baseline_s)  # the good clients' baseline, before the flood
    ka.phase = fresh.phase = "during"
    sem = asyncio.Semaphore(args.connect_concurrency)
    timeline = []
    t0 = time.monotonic()
    cap_full_at = [None]

    async def open_one():
        async with sem:
            proto = Held(stats)
            try:
                await asyncio.wait_for(loop.create_connection(lambda: proto, HOST, target.port), 10)
                held.append(proto)
                if cap_full_at[0] is None and stats["too_many_connections"]:
                    cap_full_at[0] = time.monotonic() - t0
            except (OSError, asyncio.TimeoutError) as exc:
                name = err_name(exc)
                errors[name] = errors.get(name, 0) + 1

    async def sampler():
        while True:
            timeline.append((round(time.monotonic() - t0, 1), stats["open"], stats["too_many_connections"],
                             fd_count(pid)))
            await asyncio.sleep(0.5)

    sampling = loop.create_task(sampler())
    await asyncio.gather(*(open_one() for _ in range(args.connflood_conns)))
    flood_s = time.monotonic() - t0
    log(f"[connflood] {len(held)} connected in {flood_s:.1f} s, {stats['open']} held, "
        f"{stats['too_many_connections']} got 503 too many connections; holding {args.connflood_hold_s:g} s")
    await asyncio.sleep(args.connflood_hold_s)
    held_at_end = stats["open"]
    server_fds_at_end = fd_count(pid)
    ka.phase = fresh.phase = "after"
    stats["closing"] = True
    for p in held:
        if p.transport is not None and not p.transport.is_closing():
            p.transport.close()
    await asyncio.sleep(args.connflood_after_s)
    ka.stopped = fresh.stopped = True
    await asyncio.gather(*good_tasks)
    sampling.cancel()
    await asyncio.gather(sampling, return_exceptions=True)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    ka_during, fresh_during = ka.summary("during"), fresh.summary("during")
    # Target: keep-alive client only 200s; fresh client 200 or 503 (with the cap reached), nothing else.
    cap_reached = stats["too_many_connections"] > 0
    fresh_bad = {k: v for k, v in fresh_during["statuses"].items() if k != "200" and not (k == "503" and cap_reached)}
    ok = (ka_during["requests"] > 0 and ka_during["ok"] == ka_during["requests"] and not fresh_bad
          and ka.summary("after")["ok"] == ka.summary("after")["requests"]
          and fresh.summary("after")["ok"] == fresh.summary("after")["requests"])
    return {
        "attempted": args.connflood_conns, "client_fd_soft_limit": soft, "connected": len(held),
        "connect_errors": errors, "connect_seconds": round(flood_s, 2),
        "peak_held_by_client": stats["peak_open"], "held_at_end_of_hold": held_at_end,
        "server_fds_at_end_of_hold": server_fds_at_end,
        "answered_503_too_many_connections": stats["too_many_connections"],
        "first_503_after_s": round(cap_full_at[0], 2) if cap_full_at[0] is not None else None,
        "closed_by_server": stats["closed_by_server"],
        "other": {k: v for k, v in stats.items() if k.startswith(("answered_", "closed_without_answer_"))},
        "timeline": {"t_s": [x[0] for x in timeline], "client_open": [x[1] for x in timeline],
                     "answered_503_too_many": [x[2] for x in timeline], "server_fds": [x[3] for x in timeline]},
        "good_keepalive": {"before": ka.summary("before"), "during": ka_during, "after": ka.summary("after"),
                           "reconnects": ka.reconnects},
        "good_fresh": {"before": fresh.summary("before"), "during": fresh_during, "after": fresh.summary("after")},
        "good_fresh_unacceptable": fresh_bad,
        "pass": bool(ok),
    }


def part_connflood(args, dataset, model) -> dict:
    extra = ["--max-connections", str(args.max_connections), *args.serve_args]
    srv = start_server(dataset, model, extra, "connflood")
    try:
        target = Target.discover(HOST, srv.port)
        PORT[0] = srv.port
        res = run_async(connflood(args, target, srv.proc.pid))
        res["max_connections"] = args.max_connections
        res["server_alive"] = srv.proc.poll() is None
        res["pass"] = res["pass"] and res["server_alive"]
    except BaseException:
        srv.stop()
        raise
    return finish(srv, res)


# --- 4. SIGTERM under overload ---------------------------------------------------------------------
class Pool:
    """Keep-alive connections for open- and closed-loop 1-seed inferences, at most max_conns
    (open or opening). A request takes an idle connection or opens one and writes the request
    as soon as it is connected (as a balancer does). Every request's fate is recorded:
    ("answered", status) | ("refused", errno) | ("connect_error", why) |
    ("lost_after_send", why, "new"|"reused") | ("not_sent", why) | None (no outcome yet)."""

    def __init__(self, target: Target, seed: int = 0, max_conns: int = 1 << 30, seeds: int = 1):
        self.target, self.max_conns, self.seeds = target, max_conns, seeds
        self.rng = np.random.default_rng(seed)
        self.idle: list[HttpConn] = []
        self.conns: set[HttpConn] = set()  # open or opening
        self.fate: list = []
        self.sent_at: list[float] = []
        self.done_at: list[float] = []
        self.outstanding = 0
        self.opening: set[asyncio.Task] = set()
        self.on_done = None  # closed loop: called with the connection that became idle
        self.new_connections = 0
        self.lost_conn: dict[int, tuple] = {}  # request -> (its connection's connect time, bytes it got)

    def body(self) -> bytes:
        t = self.target
        if self.seeds == 1:
            return infer_bytes(t.port, t.model, int(self.rng.integers(t.num_nodes)))
        ids = ",".join(str(int(x)) for x in self.rng.integers(t.num_nodes, size=self.seeds)).encode()
        body = b'{"inputs":[{"name":"node_ids","shape":[%d],"datatype":"INT64","data":[%s]}]}' % (self.seeds, ids)
        return (b"POST /v2/models/%s/infer HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (t.model.encode(), HOST.encode(), t.port, len(body))) + body

    def _answer(self, conn, i, status, keep):
        self._finish(i, ("answered", status))
        if keep and not conn.closed:
            if self.on_done is not None:
                self.on_done(conn)
            else:
                self.idle.append(conn)
        else:
            self.conns.discard(conn)

    def _lost(self, conn, i, why):
        self.conns.discard(conn)
        if conn in self.idle:
            self.idle.remove(conn)
        if i is not None:
            self._finish(i, ("lost_after_send", why, "reused" if conn.requests > 1 else "new"))
            self.lost_conn[i] = (conn.made_t, conn.got_bytes)

    def _finish(self, i, fate):
        if self.fate[i] is None:
            self.fate[i] = fate
            self.done_at[i] = time.monotonic()
            self.outstanding -= 1

    def new_request(self) -> int:
        i = len(self.fate)
        self.fate.append(None)
        self.sent_at.append(time.monotonic())
        self.done_at.append(0.0)
        self.outstanding += 1
        return i

    def request(self) -> int:
        i = self.new_request()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and not conn.eof:
                try:
                    conn.send(self.body(), i)
                    return i
                except ConnectionError:
                    continue
        if len(self.conns) >= self.max_conns:
            self._finish(i, ("not_sent", "client_connections_all_busy"))
            return i
        conn = HttpConn(self._answer, self._lost, first=(self.body(), i))
        self.conns.add(conn)
        task = asyncio.get_running_loop().create_task(self._open(conn, i))
        self.opening.add(task)
        task.add_done_callback(self.opening.discard)
        return i

    async def _open(self, conn: HttpConn, i: int) -> None:
        try:
            await connect(lambda: conn, 10.0)
            self.new_connections += 1
        except ConnectionRefusedError:
            self.conns.discard(conn)
            self._finish(i, ("refused", "ECONNREFUSED"))
        except (OSError, asyncio.TimeoutError) as exc:
            self.conns.discard(conn)
            self._finish(i, ("connect_error", err_name(exc)))
            if conn.transport is not None:
                conn.transport.abort()

    def close(self) -> None:
        for t in self.opening:
            t.cancel()
        for c in list(self.conns):
            c.close()


async def capacity(target: Target, conns: int, duration_s: float, warm_s: float, seeds: int) -> dict:
    pool = Pool(target, seed=1, seeds=seeds)
    end = time.monotonic() + warm_s + duration_s

    def again(conn):
        if time.monotonic() < end:
            conn.send(pool.body(), pool.new_request())
        else:
            conn.close()

    pool.on_done = again
    for _ in range(conns):
        pool.request()
    await asyncio.sleep(warm_s)
    t_measure = time.monotonic()
    await asyncio.sleep(duration_s)
    deadline = time.monotonic() + 10
    while pool.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    pool.close()
    counted = [(pool.done_at[i] - pool.sent_at[i]) * 1000 for i, f in enumerate(pool.fate)
               if f == ("answered", 200) and t_measure <= pool.done_at[i] <= t_measure + duration_s]
    p50, p99 = pct(counted)
    return {"rps": round(len(counted) / duration_s, 1), "connections": conns, "seconds": duration_s,
            "p50_ms": p50, "p99_ms": p99, "non_200": sum(1 for f in pool.fate if f != ("answered", 200))}


async def sigterm_run(args, target: Target, srv: Server) -> dict:
    cap = await capacity(target, args.capacity_conns, args.capacity_s, 0.5, args.sigterm_seeds)
    log(f"[sigterm] capacity {cap['rps']} req/s closed-loop ({cap['connections']} connections, p50 {cap['p50_ms']} ms)")
    rate = max(1.0, args.overload * cap["rps"])
    pool = Pool(target, seed=2, max_conns=args.sigterm_max_conns, seeds=args.sigterm_seeds)
    rng = np.random.default_rng(3)
    t0 = time.monotonic()
    next_t = t0
    t_sig = exit_t = None
    skipped = 0  # arrivals the client was too late for (> 50 ms behind): not offered, counted
    at_sig = {}
    while True:
        now = time.monotonic()
        if t_sig is None and now - t0 >= args.sigterm_after_s:
            srv.proc.send_signal(signal.SIGTERM)
            t_sig = now
            at_sig = {"outstanding": pool.outstanding, "connections": len(pool.conns), "requests": len(pool.fate),
                      "skipped": skipped}
            log(f"[sigterm] SIGTERM after {now - t0:.1f} s; {len(pool.fate) / (now - t0):.0f} req/s issued of "
                f"{rate:.0f} offered; {pool.outstanding} outstanding on {len(pool.conns)} connections")
        if t_sig is not None and srv.proc.poll() is not None:
            exit_t = time.monotonic()
            break
        if t_sig is not None and now - t_sig > args.sigterm_wait_s:
            break
        while next_t <= now:
            if now - next_t > 0.05:
                skipped += 1
            else:
                pool.request()
            next_t += rng.exponential(1.0 / rate)
        await asyncio.sleep(max(0.0, min(0.002, next_t - time.monotonic())))
    # The server has exited: what is still outstanding ends with a close or a reset.
    deadline = time.monotonic() + 5
    while pool.outstanding and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    pool.close()
    code = srv.proc.returncode if exit_t is not None else None
    ref = t_sig or t0
    counts: dict[str, int] = {}
    lost_examples = []
    lost_at: list[float] = []
    phases = {"issued_before_sigterm": {}, "issued_after_sigterm": {}}
    for i, f in enumerate(pool.fate):
        if f is None:
            key = "no_outcome_5s_after_exit"
        elif f[0] == "answered":
            key = f"answered_{f[1]}"
        elif f[0] == "lost_after_send":
            key = f"lost_after_send_{f[1]}_{f[2]}_connection"
            made, got = pool.lost_conn.get(i, (None, None))
            lost_at.append(pool.done_at[i] - ref)
            if sum(1 for e in lost_examples if e["why"] == f[1] and e["connection"] == f[2]) < 2:
                lost_examples.append({"issued_rel_sigterm_s": round(pool.sent_at[i] - ref, 3),
                                      "connected_and_sent_rel_sigterm_s": round(made - ref, 3) if made else None,
                                      "lost_rel_sigterm_s": round(pool.done_at[i] - ref, 3),
                                      "lost_rel_exit_s": round(pool.done_at[i] - exit_t, 3) if exit_t else None,
                                      "why": f[1], "connection": f[2], "bytes_received_on_it": got})
        else:
            key = f"{f[0]}_{f[1]}"
        counts[key] = counts.get(key, 0) + 1
        ph = phases["issued_before_sigterm" if t_sig is None or pool.sent_at[i] < t_sig else "issued_after_sigterm"]
        ph[key] = ph.get(key, 0) + 1
    lost = sum(v for k, v in counts.items() if k.startswith(("lost_after_send", "no_outcome")))
    answered = sum(v for k, v in counts.items() if k.startswith("answered_"))
    lat_before = [(pool.done_at[i] - pool.sent_at[i]) * 1000 for i, f in enumerate(pool.fate)
                  if f == ("answered", 200) and (t_sig is None or pool.sent_at[i] < t_sig)]
    p50, p99 = pct(lat_before)
    issued_before = at_sig.get("requests", len(pool.fate))
    return {
        "capacity": cap, "seeds_per_request": args.sigterm_seeds, "overload": args.overload,
        "offered_rps": round(rate, 1),
        "issued_rps_before_sigterm": round(issued_before / max(1e-9, (t_sig or time.monotonic()) - t0), 1),
        "skipped_client_behind": skipped, "max_client_connections": args.sigterm_max_conns,
        "before_sigterm_200_latency_ms": {"p50": p50, "p99": p99},
        "sigterm_after_s": args.sigterm_after_s, "at_sigterm": at_sig,
        "exit_after_sigterm_s": round(exit_t - t_sig, 2) if exit_t and t_sig else None, "exit_code": code,
        "requests": len(pool.fate), "new_connections": pool.new_connections,
        "answered": answered, "refused_at_connect": counts.get("refused_ECONNREFUSED", 0),
        "not_sent_client_busy": counts.get("not_sent_client_connections_all_busy", 0),
        "closed_or_reset_after_send": lost,
        "counts": dict(sorted(counts.items())), "by_issue_time": phases,
        "lost_rel_sigterm_s": {"min": round(min(lost_at), 3), "max": round(max(lost_at), 3)} if lost_at else None,
        "lost_examples": lost_examples,
        "pass": lost == 0 and exit_t is not None and code == 0,
    }


def part_sigterm(args, dataset, model) -> dict:
    srv = start_server(dataset, model, list(args.serve_args), "sigterm")
    try:
        target = Target.discover(HOST, srv.port)
        PORT[0] = srv.port
        res = run_async(sigterm_run(args, target, srv))
    except BaseException:
        srv.stop()
        raise
    return finish(srv, res)


# --- main ------------------------------------------------------------------------------------------
def table(report: dict) -> str:
    rows = []
    p = report["parts"]
    f = p.get("flood")
    if f and "exception" not in f:
        rows.append(("flood", (f"sent {f['sent_mib']} MiB ({f['outcome']}); RSS +{f['rss_growth_mib']} MiB "
                              f"(max {f['rss_max_mib']}); good request during: {f['good_request_during'].get('status')}"),
                     f"RSS growth <= {f['rss_limit_mib']:g} MiB, good request 200", f["pass"]))
    s = p.get("slowloris")
    if s and "exception" not in s:
        rows.append(("slowloris", (f"{s['closed_by_server_within_T_plus_1']}/{s['connected']} closed (FIN) within T+1, "
                                  f"max {s['closed_after_first_byte_s']['max']} s; server released all "
                                  + (f"{s['server_released_all_s_after_last_first_byte']} s after the last first byte; "
                                     if s["server_released_all_s_after_last_first_byte"] is not None
                                     else "connections: not seen within the watch; ")
                                  + f"good {s['good_keepalive']['ok']}/{s['good_keepalive']['requests']} keep-alive, "
                                  f"{s['good_fresh']['ok']}/{s['good_fresh']['requests']} fresh"),
                     f"all closed within T+1 = {s['request_timeout_s'] + 1:g} s", s["pass"]))
    c = p.get("connflood")
    if c and "exception" not in c:
        ka, fr = c["good_keepalive"]["during"], c["good_fresh"]["during"]
        rows.append(("connflood", (f"{c['connected']}/{c['attempted']} connected, {c['answered_503_too_many_connections']} "
                                  f"got 503 (cap {c['max_connections']}); keep-alive {ka['ok']}/{ka['requests']} 200 "
                                  f"p50/p99 {ka['p50_ms']}/{ka['p99_ms']} ms; fresh {fr['statuses']}"),
                     "keep-alive all 200; fresh 200, or 503 at the cap", c["pass"]))
    t = p.get("sigterm")
    if t and "exception" not in t:
        rows.append(("sigterm", (f"{t['requests']} issued at {t['offered_rps']} req/s offered (capacity "
                                f"{t['capacity']['rps']}): answered {t['answered']}, refused {t['refused_at_connect']}, "
                                f"lost after send {t['closed_or_reset_after_send']}; exit {t['exit_code']} "
                                f"{t['exit_after_sigterm_s']} s after SIGTERM"),
                     "lost after send == 0", t["pass"]))
    for name, r in p.items():
        if "exception" in r:
            rows.append((name, r["exception"][:200], "", False))
    w = max((len(r[0]) for r in rows), default=8)
    lines = [f"machine: {report['machine']}"]
    for name, result, tgt, ok in rows:
        lines.append(f"{name:<{w}}  {'PASS' if ok else 'MISS'}  {result}  [target: {tgt}]")
    return "\n".join(lines)


def dumps(obj, indent: int = 0) -> str:
    """JSON, indented, with lists of plain values on one line."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(str(k))}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in obj):
        return "[\n" + ",\n".join(f"{inner}{dumps(v, indent + 1)}" for v in obj) + f"\n{pad}]"
    return json.dumps(obj)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    ap.add_argument("--small", action="store_true", help="a 3,000-node graph built in a temporary directory")
    ap.add_argument("--dataset", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--json-out", type=Path, default=None, help="also write the JSON summary here")
    g = ap.add_argument_group("flood")
    g.add_argument("--flood-mib", type=float, default=1024.0, help="bytes of pipelined requests to send (MiB)")
    g.add_argument("--flood-request", choices=["live", "infer", "lookup"], default="live",
                   help="GET /v2/health/live, a 1-seed JSON inference, or a 1-seed precomputed lookup (the model "
                        "needs its embeddings)")
    g.add_argument("--flood-stall-s", type=float, default=5.0, help="no progress this long: the server paused")
    g.add_argument("--rss-limit-mib", type=float, default=32.0, help="target: server RSS growth at most this")
    g = ap.add_argument_group("slowloris")
    g.add_argument("--slowloris-conns", type=int, default=2000)
    g.add_argument("--request-timeout-s", type=float, default=5.0, help="the server's --request-timeout-s")
    g.add_argument("--byte-interval-s", type=lambda s: tuple(float(x) for x in s.split(",")), default=(1.0, 2.0),
                   help="LO,HI: seconds between one connection's bytes, uniform")
    g.add_argument("--slowloris-grace-s", type=float, default=3.0,
                   help="run until every connection is released or 2T + this after the last first byte")
    g = ap.add_argument_group("connflood")
    g.add_argument("--connflood-conns", type=int, default=20_000, help="connection attempts (held)")
    g.add_argument("--max-connections", type=int, default=5000, help="the server's --max-connections")
    g.add_argument("--connflood-hold-s", type=float, default=3.0, help="hold the flood this long once opened")
    g.add_argument("--connflood-baseline-s", type=float, default=1.0, help="good clients alone before the flood")
    g.add_argument("--connflood-after-s", type=float, default=1.0, help="good clients after the flood closes")
    g.add_argument("--connect-concurrency", type=int, default=256, help="connection attempts in flight at once")
    g.add_argument("--good-interval-ms", type=float, default=100.0, help="a good client's request period")
    g = ap.add_argument_group("sigterm")
    g.add_argument("--capacity-s", type=float, default=3.0, help="closed-loop capacity measurement")
    g.add_argument("--capacity-conns", type=int, default=32, help="closed-loop connections")
    g.add_argument("--overload", type=float, default=2.0, help="offered rate, times the capacity")
    g.add_argument("--sigterm-after-s", type=float, default=3.0, help="overload this long, then SIGTERM")
    g.add_argument("--sigterm-seeds", type=int, default=1, help="node ids per inference request")
    g.add_argument("--sigterm-max-conns", type=int, default=2048,
                   help="client connections at most (open or opening); past it an arrival is not sent (counted)")
    g.add_argument("--sigterm-wait-s", type=float, default=60.0, help="give up if the server has not exited")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then extra flags for every `hybridgnn serve`")
    args = ap.parse_args()
    args.serve_args = [a for a in args.serve_args if a != "--"]
    parts = [p for p in args.only.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    lo, hi = args.byte_interval_s if len(args.byte_interval_s) == 2 else (args.byte_interval_s[0],) * 2
    args.byte_interval_s = (lo, hi)

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    tmp = None
    if args.small:
        tmp = tempfile.TemporaryDirectory(prefix="hybridgnn-abuse-")
        t0 = time.monotonic()
        dataset, model = small_dataset(Path(tmp.name))
        log(f"small graph and model built in {time.monotonic() - t0:.1f} s")
    elif args.dataset and args.model:
        dataset, model = args.dataset, args.model
    else:
        from hybridgnn.demo import ensure_demo

        dataset, model = ensure_demo()
    report = {"machine": machine(), "dataset": "small (3,000 nodes)" if args.small else str(dataset),
              "model": None if args.small else str(model), "serve_args": args.serve_args,
              "client_fd_limit": fd_limit, "parts": {}}
    runners = {"flood": part_flood, "slowloris": part_slowloris, "connflood": part_connflood, "sigterm": part_sigterm}
    started = time.monotonic()
    try:
        for name in PARTS:
            if name not in parts:
                continue
            t0 = time.monotonic()
            log(f"[{name}] starting")
            try:
                res = runners[name](args, dataset, model)
            except Exception as exc:  # noqa: BLE001 - one part failing still reports the others
                import traceback

                traceback.print_exc()
                res = {"exception": f"{type(exc).__name__}: {exc}", "pass": False}
            res["part_seconds"] = round(time.monotonic() - t0, 1)
            report["parts"][name] = res
            log(f"[{name}] {'PASS' if res.get('pass') else 'MISS'} in {res['part_seconds']} s")
    finally:
        if tmp is not None:
            tmp.cleanup()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["pass"] = all(r.get("pass") for r in report["parts"].values())
    print(table(report))
    text = dumps(finite(report))  # strict JSON: a figure with no value is null
    print(text)
    if args.json_out is not None:
        args.json_out.write_text(text + "\n")
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
