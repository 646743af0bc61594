"""Server CPU per request, all processes and threads together, against a minimal httptools
echo server (bench/echo_server.py) measured in the same run on the same machine.

1. One-seed precomputed JSON requests one after another on one keep-alive connection
   (closed loop: no batching, no overlap): CPU µs per request of the echo server, of
   `hybridgnn serve --frontends 1` (HTTP in the engine's process) and of `--frontends 2`
   (two front-end processes and the engine's), and each server ÷ echo.
2. A 64-seed precomputed request of the `embeddings` output (a model of hidden width
   --hidden-dim, trained and precomputed once into the bench cache), JSON against the
   binary tensor extension: bytes on the wire per request (both directions) and server CPU
   per request, JSON ÷ binary.

The CPU figure is the on-CPU time of the server's process and every process it started
(front ends, workers), all threads, from the scheduler's accounting (/proc/.../sched;
/proc stat where that is missing), read around each server's own requests and divided by
them; the client (this process) is not counted. The one-seed figure is taken two ways
(--modes), --requests per server per round, --rounds rounds (medians reported):
- turns: the servers run at once and take turns in chunks of --chunk requests, the order
  rotating, so drift of the machine's speed falls on all of them alike; beside them run
  hybridgnn's HTTP layer answering one fixed answer (echo_server.py --protocol: what the
  protocol costs before any endpoint work) and the echo server busy-waiting 20 µs per
  request (--work-us: what a little work costs in place here, the yardstick for the
  others: a server that answers later lets the client's core sleep, and on a VM waking
  it costs more than the work);
- alone: each server alone on the machine, one after another (started and stopped in
  turn). On this 2-core VM the echo server costs about twice as much this way (about
  60 against 30 µs per request: each request wakes an idle core), and the servers about
  the same, so the ratio depends on the way.

With --cpu N everything (this bench, every server and its processes) runs on core N: a
request then costs what its work costs, since no core sleeps while another works and no
sleeping core is woken (on this VM the turns' ratios then agree within a few per cent
from round to round, where unpinned runs differ by 1.5x between runs).

    .venv/bin/python bench/frontend_cpu.py [--requests 5000] [--rounds 3] [--chunk 1000] [--modes turns,alone]
    .venv/bin/python bench/frontend_cpu.py --modes turns --cpu 1 [--varied] [--no-wide] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    emit_report,
    machine,
    process_tree_cpu_seconds,
    serve_accepts,
    serve_revision,
)
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.support.server import free_port, stop_process  # noqa: E402

HEADER_LENGTH = "Inference-Header-Content-Length"
WORK_US = 20.0  # the yardstick server's busy work per request
WORKED = f"echo + {WORK_US:g} µs of work"


def http_request(path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class Client:
    """One keep-alive connection; send a request, read its whole answer."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def ask(self, wire: bytes) -> tuple[int, bytes]:
        self.sock.sendall(wire)
        while b"\r\n\r\n" not in self.buf:
            self.buf += self.sock.recv(1 << 20)
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        while len(rest) < length:
            rest += self.sock.recv(1 << 20)
        self.buf = rest[length:]
        return status, head + b"\r\n\r\n" + rest[:length]

    def close(self) -> None:
        self.sock.close()


def cpu_per_request(pid: int, port: int, wires: list[bytes], count: int) -> tuple[float, int]:
    """(server CPU µs per request, answer bytes per request) over `count` requests one
    after another, after a warm-up."""
    client = Client(port)
    try:
        warm_up(client, wires, min(500, count))
        spent, answered = timed_chunk(pid, client, wires, count, 0)
    finally:
        client.close()
    return spent / count * 1e6, answered // count


def warm_up(client: Client, wires: list[bytes], count: int) -> None:
    for i in range(count):
        status, answer = client.ask(wires[i % len(wires)])
        assert status == 200, answer[:300]


def timed_chunk(pid: int, client: Client, wires: list[bytes], count: int, start: int) -> tuple[float, int]:
    """(server CPU seconds, answer bytes) of `count` requests one after another."""
    before = process_tree_cpu_seconds(pid)
    answered = 0
    for i in range(start, start + count):
        status, answer = client.ask(wires[i % len(wires)])
        answered += len(answer)
    return process_tree_cpu_seconds(pid) - before, answered


def interleaved_cpu(servers: dict[str, tuple[int, int]], wires: list[bytes], count: int, chunk: int
                    ) -> dict[str, float]:
    """Server CPU µs per request of each server {name: (pid, port)}, all running at once,
    measured in chunks of `chunk` requests taken in turn (the order rotating), `count`
    requests each: drift of the machine's speed falls on every server alike. Each chunk's
    CPU is read around that chunk only, so a server's idle timers while the others are
    measured are not counted."""
    clients = {name: Client(port) for name, (_, port) in servers.items()}
    spent = dict.fromkeys(servers, 0.0)
    try:
        for name, client in clients.items():
            warm_up(client, wires, 500)
        names = list(servers)
        for turn in range(max(1, count // chunk)):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                spent[name] += timed_chunk(servers[name][0], clients[name], wires, chunk, turn * chunk)[0]
    finally:
        for client in clients.values():
            client.close()
    done = max(1, count // chunk) * chunk
    return {name: cpu / done * 1e6 for name, cpu in spent.items()}


class EchoServer:
    """bench/echo_server.py (protocol: hybridgnn's HTTP layer with one fixed answer;
    work_us: the echo server busy-waits that long per request)."""

    def __init__(self, protocol: bool = False, work_us: float = 0.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "echo_server.py"), "--port",
                                      str(self.port), *(["--protocol"] if protocol else []),
                                      *(["--work-us", f"{work_us:g}"] if work_us else [])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)  # poll interval, bounded by the deadline

    def stop(self) -> None:
        stop_process(self.proc)


def one_seed_wires(num_nodes: int, path: str, varied: bool = False) -> list[bytes]:
    """One-seed lookups as a client sends them: the same body but the id, the same head but
    Content-Length. varied: each request also names its own request id, in a header and in
    the body, as a tracing client does (4,096 distinct requests, so the server keeps none of
    their heads or bodies' forms)."""
    rng = np.random.default_rng(0)
    count = 4096 if varied else 256
    return [http_request(path, json.dumps({
        "inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [int(node)]}],
        "parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}],
        **({"id": f"r{k}"} if varied else {})}).encode(), {"X-Request-Id": f"r{k}"} if varied else None)
        for k, node in enumerate(rng.integers(0, num_nodes, count))]


def wide_wires(num_nodes: int, path: str, binary: bool, seeds: int = 64) -> list[bytes]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(64):
        ids = rng.integers(0, num_nodes, seeds)
        if binary:
            head = json.dumps({"inputs": [{"name": "node_ids", "shape": [seeds], "datatype": "INT64",
                                           "parameters": {"binary_data_size": seeds * 8}}],
                               "parameters": {"mode": "precomputed", "binary_data_output": True},
                               "outputs": [{"name": "embeddings"}]}).encode()
            out.append(http_request(path, head + ids.astype("<i8").tobytes(), {HEADER_LENGTH: str(len(head))}))
        else:
            out.append(http_request(path, json.dumps({
                "inputs": [{"name": "node_ids", "shape": [seeds], "datatype": "INT64", "data": ids.tolist()}],
                "parameters": {"mode": "precomputed"}, "outputs": [{"name": "embeddings"}]}).encode()))
    return out


def wide_model(dataset: Path, hidden: int) -> Path:
    """A SAGE model of hidden width `hidden` on the demo graph, with its embeddings (made once)."""
    model = dataset.parent / f"model-hidden{hidden}"
    if not (model / "embeddings").exists():
        cli = [sys.executable, "-m", "hybridgnn.cli.main", "--log-level", "WARNING"]
        subprocess.run([*cli, "train", "--dataset", str(dataset), "--out", str(model), "--hidden-dim", str(hidden),
                        "--epochs", "1", "--force"], check=True)  # a model left without embeddings: trained again
        subprocess.run([*cli, "precompute", "--dataset", str(dataset), "--model", str(model)], check=True)
    return model


def in_turns(dataset, model, wires, args) -> dict[str, list[float]]:
    """All the servers running at once, taking turns (interleaved_cpu), per round; beside
    them hybridgnn's HTTP layer alone with a fixed answer ("protocol only") and the echo
    server doing WORK_US of busy work per request ("echo + work")."""
    runs: dict[str, list[float]] = {"echo": [], WORKED: [], "protocol only": [], "frontends 1": [],
                                    "frontends 2": []}
    echo, worked, protocol, servers = EchoServer(), EchoServer(work_us=WORK_US), EchoServer(protocol=True), {}
    try:
        for n in (1, 2):
            servers[f"frontends {n}"] = serve_revision(None, dataset, model, "--frontends", str(n))
        if args.baseline_rev:  # the same server from another revision, beside this one
            runs[f"frontends 1 at {args.baseline_rev}"] = []
            # a revision from before --frontends serves HTTP in the engine's process: what --frontends 1 is
            one = ("--frontends", "1") if serve_accepts(args.baseline_rev, "--frontends") else ()
            servers[f"frontends 1 at {args.baseline_rev}"] = serve_revision(args.baseline_rev, dataset, model, *one)
        endpoints = {"echo": (echo.proc.pid, echo.port), WORKED: (worked.proc.pid, worked.port),
                     "protocol only": (protocol.proc.pid, protocol.port),
                     **{k: (v.pid, v.port) for k, v in servers.items()}}
        for _ in range(args.rounds):
            for name, us in interleaved_cpu(endpoints, wires, args.requests, args.chunk).items():
                runs[name].append(us)
            print("turns", json.dumps({k: round(v[-1], 1) for k, v in runs.items()}), flush=True)
    finally:
        echo.stop()
        worked.stop()
        protocol.stop()
        for srv in servers.values():
            srv.stop()
    return runs


def alone(dataset, model, wires, args) -> dict[str, list[float]]:
    """Each server alone on the machine, one after another, per round."""
    runs: dict[str, list[float]] = {"echo": [], "frontends 1": [], "frontends 2": []}
    for _ in range(args.rounds):
        echo = EchoServer()
        try:
            runs["echo"].append(cpu_per_request(echo.proc.pid, echo.port, wires, args.requests)[0])
        finally:
            echo.stop()
        for n in (1, 2):
            srv = serve_revision(None, dataset, model, "--frontends", str(n))
            try:
                runs[f"frontends {n}"].append(cpu_per_request(srv.pid, srv.port, wires, args.requests)[0])
            finally:
                srv.stop()
        print("alone", json.dumps({k: round(v[-1], 1) for k, v in runs.items()}), flush=True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1000, help="requests per turn of each server (one-seed figure)")
    ap.add_argument("--modes", default="turns,alone", help="turns (all servers up, taking turns), alone, or both")
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin this bench and every server it starts to this one core: no core sleeps while "
                         "another works, so no wake-up of a sleeping core is counted (the steadiest figure)")
    ap.add_argument("--varied", action="store_true",
                    help="one-seed requests that each name their own request id (header and body), as a tracing "
                         "client sends them: nothing of them repeats for the server to keep")
    ap.add_argument("--hidden-dim", type=int, default=256)
    ap.add_argument("--baseline-rev", help="in turns, also `--frontends 1` from this git revision")
    ap.add_argument("--no-wide", dest="wide", action="store_false", help="skip the 64-seed JSON / binary figure")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})  # the servers started from here inherit it
    dataset, model = ensure_demo()
    meta = json.loads((Path(dataset) / "meta.json").read_text()) if (Path(dataset) / "meta.json").exists() else {}
    num_nodes = int(meta.get("num_nodes", 50_000))
    path = "/v2/models/hybridgnn/infer"
    wires = one_seed_wires(num_nodes, path, args.varied)
    report = {"machine": machine(), "requests": args.requests, "rounds": args.rounds, "chunk": args.chunk,
              "pinned_cpu": args.cpu, "varied": args.varied}
    for mode in args.modes.split(","):
        runs = (in_turns if mode == "turns" else alone)(dataset, model, wires, args)
        median = {k: statistics.median(v) for k, v in runs.items()}
        per_round = {k: [server / echo for server, echo in zip(runs[k], runs["echo"], strict=True)]
                     for k in runs if k != "echo"}
        report[mode] = {"one_seed_json_cpu_us": {k: round(v, 1) for k, v in median.items()},
                        "server_over_echo": {k: round(statistics.median(v), 2) for k, v in per_round.items()},
                        "server_over_echo_per_round": {k: [round(x, 2) for x in v] for k, v in per_round.items()},
                        "rounds_cpu_us": {k: [round(x, 1) for x in v] for k, v in runs.items()}}
        base = f"frontends 1 at {args.baseline_rev}"
        if base in runs:
            report[mode]["baseline_over_frontends_1"] = round(statistics.median(
                b / f for b, f in zip(runs[base], runs["frontends 1"], strict=True)), 2)
    if args.wide:
        report["wide"] = wide_figure(dataset, num_nodes, path, args)
    emit_report(report, args.out)


def wide_figure(dataset, num_nodes: int, path: str, args) -> dict:
    """Bytes and server CPU per 64-seed request of embeddings, JSON against binary."""
    wide = wide_model(Path(dataset), args.hidden_dim)
    srv = serve_revision(None, dataset, wide)
    try:
        sizes, cpu = {}, {}
        for kind, binary in (("json", False), ("binary", True)):
            ws = wide_wires(num_nodes, path, binary)
            samples = [cpu_per_request(srv.pid, srv.port, ws, max(500, args.requests // 5)) for _ in range(args.rounds)]
            cpu[kind] = statistics.median(s[0] for s in samples)
            sizes[kind] = sum(len(w) for w in ws) // len(ws) + samples[0][1]
    finally:
        srv.stop()
    return {"seeds": 64, "embedding_dim": args.hidden_dim, "bytes_per_request": sizes,
            "cpu_us_per_request": {k: round(v, 1) for k, v in cpu.items()},
            "json_over_binary": {"bytes": round(sizes["json"] / sizes["binary"], 2),
                                 "cpu": round(cpu["json"] / cpu["binary"], 2)}}


if __name__ == "__main__":
    main()
