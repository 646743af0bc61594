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

The CPU figure is user + system seconds from /proc of the server's process and every
process it started (front ends, workers), before and after --requests requests, divided
by the requests; the client (this process) is not counted. --rounds > 1 repeats each
measurement and reports the median (of each server's CPU, and of each round's server ÷
echo: the rounds interleave the servers, and the machine drifts between rounds).

    .venv/bin/python bench/frontend_cpu.py [--requests 5000] [--rounds 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import (  # noqa: E402
    _stat_cpu_seconds,
    descendants_cpu_seconds,
    emit_report,
    machine,
    serve_revision,
)
from hybridgnn.demo import ensure_demo  # noqa: E402
from tests.support.server import free_port, stop_process  # noqa: E402

HEADER_LENGTH = "Inference-Header-Content-Length"


def tree_cpu_seconds(pid: int) -> float:
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text()) + descendants_cpu_seconds(pid)


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
        for i in range(min(500, count)):
            status, answer = client.ask(wires[i % len(wires)])
            assert status == 200, answer[:300]
        before = tree_cpu_seconds(pid)
        answered = 0
        for i in range(count):
            status, answer = client.ask(wires[i % len(wires)])
            answered += len(answer)
        spent = tree_cpu_seconds(pid) - before
    finally:
        client.close()
    return spent / count * 1e6, answered // count


class EchoServer:
    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "echo_server.py"), "--port",
                                      str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def one_seed_wires(num_nodes: int, path: str) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [http_request(path, json.dumps({
        "inputs": [{"name": "node_ids", "shape": [1], "datatype": "INT64", "data": [int(i)]}],
        "parameters": {"mode": "precomputed"}, "outputs": [{"name": "logits"}]}).encode())
        for i in rng.integers(0, num_nodes, 256)]


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
                        "--epochs", "1"], check=True)
        subprocess.run([*cli, "precompute", "--dataset", str(dataset), "--model", str(model)], check=True)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden-dim", type=int, default=256)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dataset, model = ensure_demo()
    meta = json.loads((Path(dataset) / "meta.json").read_text()) if (Path(dataset) / "meta.json").exists() else {}
    num_nodes = int(meta.get("num_nodes", 50_000))
    path = "/v2/models/hybridgnn/infer"
    wires = one_seed_wires(num_nodes, path)
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
        print(json.dumps({k: round(v[-1], 1) for k, v in runs.items()}), flush=True)
    median = {k: statistics.median(v) for k, v in runs.items()}
    # Each round measures the three servers one after another; this VM's speed drifts
    # between rounds far more than within one, so the ratio is taken per round first.
    per_round = {k: [server / echo for server, echo in zip(runs[k], runs["echo"], strict=True)]
                 for k in ("frontends 1", "frontends 2")}
    report = {"machine": machine(), "requests": args.requests, "rounds": args.rounds,
              "one_seed_json_cpu_us": {k: round(v, 1) for k, v in median.items()},
              "server_over_echo": {k: round(statistics.median(v), 2) for k, v in per_round.items()},
              "server_over_echo_per_round": {k: [round(x, 2) for x in v] for k, v in per_round.items()},
              "rounds_cpu_us": {k: [round(x, 1) for x in v] for k, v in runs.items()}}
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
    report["wide"] = {"seeds": 64, "embedding_dim": args.hidden_dim, "bytes_per_request": sizes,
                      "cpu_us_per_request": {k: round(v, 1) for k, v in cpu.items()},
                      "json_over_binary": {"bytes": round(sizes["json"] / sizes["binary"], 2),
                                           "cpu": round(cpu["json"] / cpu["binary"], 2)}}
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
